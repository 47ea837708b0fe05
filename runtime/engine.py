"""Assemble a decoding engine from user-facing options: model, budget, hot experts, slow tier."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

from .kernels import select_ops
from .offload.memory import Budget, MemoryPlan, fmt_bytes, measured_peak, plan_memory, release_freed_memory_promptly
from .kernels.backend import NUMPY, Backend
from .offload.cache import DEFAULT_POLICY, ExpertCache
from .checks import expert_pairs, number
from . import jsonfile
from .errors import UsageError
from .model.loader import LoadedModel, load_model
from .model.forward import MoEModel
from .model.kv_cache import resolve_cache_type
from .offload.store import Emulation, ExpertStore


@dataclass
class Engine:
    loaded: LoadedModel
    model: MoEModel
    cache: ExpertCache
    plan: MemoryPlan
    budget: Budget
    emulation: Emulation

    def phase(self, name: str):
        return self.cache.in_phase(name)

    def report(self) -> dict:
        r = {"budget": self.budget.describe(), "memory": self.plan.to_dict(), "cache": self.cache.report(),
             "prefill_chunk": self.model.prefill_chunk,
             "kv_cache_type": self.model.cache_type,
             "measured": measured_peak(),
             "kernels": {"name": self.model.ops.name, "reason": self.model.ops.reason,
                         "path": getattr(self.model.ops, "path", "numpy"),
                         "threads": getattr(self.model.ops, "threads", 1)}}
        r["direct_io"] = all(self.cache.store.direct_files.values()) if self.cache.store.direct_files else None
        r["offload_tier"] = getattr(self.cache.store, "tier", "file")
        if self.emulation.active:
            r["emulation"] = self.emulation.describe()
        return r

    def close(self) -> None:
        self.cache.stop_fill()
        self.cache.store.close()


OFFLOAD_TIERS = ("file", "host")


def engine_tier(profile_tier: str | None) -> str:
    """The engine's tier for a profile's ``device.offload_tier``: pinned host RAM, else the model
    file (SSD or disk)."""
    return "host" if profile_tier == "host" else "file"


def read_hot_experts(path: str, loaded: LoadedModel) -> list[tuple[int, int]]:
    """The published format ``{"gpu_experts": [[layer, expert], ...]}``, checked against the model."""
    try:
        with open(path) as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: hot-experts file not found") from None
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"{path}: not valid JSON (expected {{\"gpu_experts\": [[layer, expert], ...]}})") from None
    entries = data.get("gpu_experts") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise UsageError(f"{path}: field 'gpu_experts' must be a list of [layer, expert] pairs")
    return expert_pairs(entries, loaded.config, f"{path}: gpu_experts")


def build_engine(
    model_path: str,
    budget: str | None = None,
    kv_positions: int = 4096,
    hot_experts: str | list[tuple[int, int]] | None = None,
    policy: str = DEFAULT_POLICY,
    emulate_bandwidth: float | None = None,
    emulate_latency: float = 0.0,
    direct_io: bool = True,
    loaded: LoadedModel | None = None,
    fetch_threads: int | None = None,
    backend: Backend = NUMPY,
    offload_tier: str = "file",
    expert_budget: str | None = None,
    kernels: str = "auto",
    threads: int | None = None,
    batch: int | None = None,
    preload: bool | str = False,
    prefetch_slots: int | None = None,
    budget_from: str = "--budget",
    trim_hot: bool = False,
    draft_vocab: int = 0,
    memory_limit: str | None = None,
    prompt_tokens: int = 0,
    cache_type: str = "auto",
) -> Engine:
    """``offload_tier``: "file" reads missing experts from the model file (Orin: SSD → pinned →
    device); "host" decodes every expert once into pinned host memory (RTX 4090: host RAM → device).

    The memory plan is made before the dense part is read (``loaded`` may come without it:
    `load_model(path, dense=False)`), so a budget too small for it fails in one line first.
    ``preload``: when every expert fits, read them all now (True: the run starts warm), or
    "background": after the prompt, on the fetch threads (offload/fill.py; the CLI's default).
    ``draft_vocab``: lm-head rows a FR-Spec draft head uses (model/draft_head.py); a copy of them,
    where it needs one, is planned with the dense part.
    ``prefetch_slots``: experts a draft may have in flight for verification (default 2 × top-k
    under a budget, 0 when every expert is resident). They take their room in the expert cache, not
    in the plan, so every method runs in the same memory.
    ``cache_type``: the KV cache's (model/kv_cache.py); auto is f16."""
    loaded = loaded or load_model(model_path, dense=False)
    parsed = Budget.parse(budget, budget_from)
    experts_only = Budget.parse(expert_budget, "--expert-budget") if expert_budget is not None else None
    if emulate_bandwidth is not None:
        number("--emulate-bandwidth", emulate_bandwidth, low=0, low_open=True)
    number("--emulate-latency", emulate_latency, low=0)
    if offload_tier not in OFFLOAD_TIERS:
        raise UsageError(f"--offload-tier {offload_tier!r}: choose from {', '.join(OFFLOAD_TIERS)}")
    ops = select_ops(kernels, threads, backend)
    cache_type = resolve_cache_type(cache_type, loaded.config)
    # the fast tier lives where the math runs, at stored size on the host (page-rounded under
    # O_DIRECT) and on a device (exact allocations)
    size_of = (lambda refs: refs.resident_bytes_for(False)) if backend.on_device else \
        (lambda refs: refs.resident_bytes_for(direct_io))
    window = 4
    everything = parsed.full and experts_only is None
    slots = default_prefetch_slots(loaded.config, everything) if prefetch_slots is None else prefetch_slots

    def make_plan(b: Budget, batch=batch):
        return plan_memory(loaded, b, kv_positions, experts_only, batch=batch, window=window,
                           reference_kernels=ops.name == "numpy", expert_bytes=size_of, direct=direct_io,
                           draft_head=draft_head_bytes(loaded, draft_vocab, backend.on_device),
                           staged_prefetches=slots if backend.on_device else 0, cache_type=cache_type)

    plan = make_plan(parsed)
    if memory_limit is not None and not backend.on_device:
        limited = _plan_to_limit(plan, make_plan, memory_limit, budget, expert_budget)
        if limited is not plan and limited.expert_capacity < plan.expert_capacity:  # the limit binds
            everything, parsed = False, Budget(total_bytes=limited.model_bytes)  # (what reports name)
            if prefetch_slots is None:  # (on the host the slots take no room of their own)
                slots = default_prefetch_slots(loaded.config, False)
        plan = limited
    chunk = wide_prefill_chunk(plan, prompt_tokens, batch, ops, backend)
    if chunk:  # a prompt in wider passes, planned so, where every expert still fits (and the limit)
        from .offload.limits import find_headroom

        wide = make_plan(parsed, chunk)
        room = find_headroom(memory_limit) if memory_limit is not None and budget is None and \
            expert_budget is None else None
        fits = wide.expert_capacity >= wide.expert_total and (room is None or wide.model_bytes <= room.model_budget())
        chunk, plan = (chunk, replace(wide, limit=plan.limit)) if fits else (0, plan)
    release_freed_memory_promptly()
    for kind, (n, stored, decoded) in loaded.without_kernel().items():
        _note(f"{n} {kind} tensors have no kernel: decoded to float32 at load, {fmt_bytes(decoded)} in memory "
              f"for {fmt_bytes(stored)} stored (llama-quantize to a K-quant, or `s2moe convert --type Q8_0`, keeps them stored)")
    if backend.on_device and hasattr(backend, "limit_memory"):  # the budget binds on the device too;
        # slack for the pool's allocation rounding and cuBLAS workspaces
        backend.limit_memory(None if everything else int(plan.model_bytes * 1.05) + (32 << 20))
    loaded.load_dense(direct_io)
    emulation = Emulation(emulate_bandwidth, emulate_latency)
    # read buffers are reused within what the plan gives experts on the host: the cache's capacity
    # (host backend) plus the streaming workspace
    pool = (0 if backend.on_device else plan.expert_capacity) + (plan.work.streaming if plan.work else 0)
    store = ExpertStore(loaded, direct=direct_io, emulation=emulation, pool_bytes=pool,
                        **({"threads": fetch_threads} if fetch_threads else {}))
    if offload_tier == "host":
        from .offload.host_tier import HostTier

        store = HostTier(store, backend)
    full = plan.expert_capacity >= plan.expert_total
    hot = read_hot_experts(hot_experts, loaded) if isinstance(hot_experts, str) else \
        expert_pairs(list(hot_experts or []), loaded.config, "hot experts")
    sizes: dict = {}  # an expert's resident bytes, worked out once (a prefetch asks on every guess)

    def size(key):
        if key not in sizes:
            sizes[key] = size_of(loaded.experts[key])
        return sizes[key]

    if trim_hot and sum(map(size, hot)) > plan.expert_capacity:  # a profile's list, the user's budget
        kept = head_that_fits(hot, size, plan.expert_capacity)
        _note(f"{budget_from} leaves {fmt_bytes(plan.expert_capacity)} for experts at this context: pinning the "
              f"profile's first {len(kept)} of {len(hot)} hot experts")
        hot = kept
    if hot and sum(map(size, hot)) > plan.expert_capacity:
        where = hot_experts if isinstance(hot_experts, str) else "hot experts"
        raise UsageError(f"{where}: {len(hot)} hot experts need {fmt_bytes(sum(map(size, hot)))}, the budget leaves "
                         f"{fmt_bytes(plan.expert_capacity)} for experts; shorten the list or raise --budget")
    cache = ExpertCache(store, None if full else plan.expert_capacity, policy, hot, size, place=backend.upload_expert,
                        window=window, prefetch_slots=0 if full else slots)
    if preload == "background" and full:  # start like mmap: the prompt reads what it needs first
        cache.fill_in_background(sorted(loaded.experts))
    elif preload and full:
        _preload(cache, sorted(loaded.experts))
    model = MoEModel(loaded, cache, backend, ops)
    model.cache_type = cache_type
    if chunk:
        model.prefill_chunk = chunk
    return Engine(loaded, model, cache, plan, parsed, emulation)


def wide_prefill_chunk(plan, prompt_tokens: int, batch: int | None, ops, backend) -> int:
    """The prompt chunk past forward.py's PREFILL_CHUNK that this run may take (0: none): the CPU
    kernels, every expert resident, and a prompt longer than a chunk. Under a budget the wider
    workspace would take expert slots, and a pass that reads experts is bound by the reads."""
    from .model.forward import PREFILL_CHUNK, WIDE_PREFILL_CHUNK

    if (prompt_tokens <= max(PREFILL_CHUNK, batch or 0) or ops.name != "cpu" or backend.on_device
            or plan.expert_capacity < plan.expert_total):
        return 0
    return min(prompt_tokens, WIDE_PREFILL_CHUNK)


def default_prefetch_slots(config, everything_resident: bool) -> int:
    """Prefetches a draft may have in flight unless told: 2 × top-k under a budget (a token's
    experts, and the next one's), none when every expert is resident."""
    return 0 if everything_resident else 2 * config.top_k


def draft_head_bytes(loaded: LoadedModel, n: int, on_device: bool = False) -> int:
    """What a draft head of ``n`` tokens holds beside the lm head. None on the host where the head
    stays stored: its rows are then a view of the full head's, stored in rank order
    (`MoEModel.draft_head`). Elsewhere a copy of that share of the rows."""
    if n <= 0:
        return 0
    head = loaded.dense_specs["lm_head"]
    if not on_device and head.keeps_stored:
        return 0
    return -(-head.resident_bytes(False) * n // loaded.config.vocab_size)


def _plan_to_limit(plan, make_plan, memory_limit: str, budget, expert_budget):
    """The plan under the process's memory limit (limits.py): ``plan`` itself where there is none
    or a budget was given, the same plan with the limit's facts where the model fits, else the
    plan for the limit's room."""
    from .offload.limits import find_headroom

    explicit = memory_limit.strip().lower() not in ("auto", "none")
    if explicit and (budget is not None or expert_budget is not None):
        raise UsageError("--memory-limit and --budget both bound the plan: give one of them")
    room = find_headroom(memory_limit)
    if room is None or budget is not None or expert_budget is not None:
        return plan
    facts = {"source": room.source, "limit_bytes": room.limit, "in_use_bytes": room.in_use,
             "model_budget_bytes": room.model_budget()}
    if plan.model_bytes <= room.model_budget():
        if explicit:
            _note(f"memory limit {fmt_bytes(room.limit)} ({room.source}), {fmt_bytes(room.in_use)} in use: "
                  f"the whole model fits ({fmt_bytes(plan.model_bytes)})")
        return replace(plan, limit=facts)
    rest = plan.model_bytes - plan.expert_capacity
    if rest > room.model_budget():
        raise UsageError(f"memory limit {fmt_bytes(room.limit)} ({room.source}) with {fmt_bytes(room.in_use)} in use "
                         f"leaves {fmt_bytes(room.model_budget())} for the model; its dense part, KV cache and "
                         f"workspace need {fmt_bytes(rest)}: raise the limit by {fmt_bytes(rest - room.model_budget())} "
                         "or more, or shorten the run (-n, the prompt)")
    limited = replace(make_plan(Budget(total_bytes=room.model_budget())), limit=facts)
    _note(f"memory limit {fmt_bytes(room.limit)} ({room.source}), {fmt_bytes(room.in_use)} in use: planning "
          f"{fmt_bytes(limited.model_bytes)} for the model, {limited.expert_share:.0%} of experts resident")
    return limited


def _note(message: str) -> None:
    import sys

    print(f"note: {message}", file=sys.stderr)


def _preload(cache: ExpertCache, keys: list) -> None:
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("loading experts", total=len(keys))
        cache.preload(keys, lambda n: progress.advance(task, n))


def head_that_fits(hot: list, size, capacity: int) -> list:
    """The longest head of a rank-ordered hot list whose experts fit in ``capacity`` bytes."""
    kept, used = [], 0
    for key in hot:
        if used + size(key) > capacity:
            break
        kept.append(key)
        used += size(key)
    return kept


def phase_of(model: MoEModel, name: str):
    """The cache's phase context when the model's provider has phases, else a no-op."""
    phase = getattr(model.experts, "in_phase", None)
    return phase(name) if phase else nullcontext()
