import os, sys
if os.environ.get("OLD") == "1":  # session 22's changes off (as far as they can be patched out)
    import numpy as np
    from s2moe.runtime.kernels.cpu import CpuOps
    CpuOps.greedy_pick = None
    from s2moe.runtime.decoding import acceptance as A
    def p(self, q):
        w = self.prior_weight
        pooled = (self.accepted.sum() + w * q) / (self.drafted.sum() + w)
        b = int(np.searchsorted(A.EDGES, q, side="right"))
        return float((self.accepted[b] + w * pooled) / (self.drafted[b] + w))
    A.AcceptanceModel.p = p
    from s2moe.runtime.offload import store as S, reader as R
    S._template = lambda refs: None
    orig = R.FileReader.check_unchanged
    R.FileReader.check_unchanged = lambda self, path, where, landed=None: orig(self, path, where)
    S.ExpertStore.stored_bytes = lambda self, layer, expert: self.refs[layer, expert].stored_bytes
    S.ExpertStore.direct = lambda self, layer, expert: all(self.reader.is_direct(p) for p in self.plan(layer, expert)[2])
    from s2moe.runtime.offload import cache as C
    def available_masks(self, layers, num_experts):
        if self.capacity is None:
            return None
        row = {L: i for i, L in enumerate(layers)}
        key = (tuple(layers), num_experts)
        base = self._avail.get(key)
        if base is None:
            rows, cols = [], []
            for L, i in row.items():
                experts = self._by_layer.get(L, ())
                rows.extend([i] * len(experts)); cols.extend(experts)
            base = np.zeros((len(layers), num_experts), dtype=bool)
            base[rows, cols] = True
            base.flags.writeable = False
            self._avail[key] = base
        mask = base.copy()
        for L, e in self._prefetched:
            if L in row:
                mask[row[L], e] = True
        return mask
    C.ExpertCache.available_masks = available_masks
from s2moe.runtime.cli import main
sys.argv = ["s2moe"] + sys.argv[1:]
main()
