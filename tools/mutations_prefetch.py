"""Mutations of draft-guided prefetch into the expert cache and the streaming workspace (session
2026-12-02: prefetch slots of their own cost the cache more than they hid). `mutations.py` joins them
to the others; what a mutation is: `mutation_kit.py`.
"""

from __future__ import annotations

from mutation_kit import Mutation

PREFETCH: list[Mutation] = [
    Mutation("prefetch-reserves-no-room", "runtime/offload/cache.py",
             "        self._reserved[key] = size\n        self.resident_bytes += size\n",
             "        self._reserved[key] = 0\n",
             ["tests/test_draft_residency.py", "-k", "into_the_cache"], "a prefetch in flight holds no room: the cache overfills when it lands"),
    Mutation("prefetch-evicts-predicted", "runtime/offload/cache.py",
             "            borrow = not self._reserve(key, self._predicted)", "            borrow = not self._reserve(key, set())",
             ["tests/test_draft_residency.py", "-k", "into_the_cache"], "a prefetch evicts an expert the same iteration predicted"),
    Mutation("prefetch-ranked-without-its-use", "runtime/offload/cache.py",
             "        return self._score(key) + coming > self._score(victim)", "        return self._score(key) > self._score(victim)",
             ["tests/test_draft_residency.py", "-k", "into_the_cache"], "a prediction ranks below the miss verification would admit"),
    Mutation("ar-reads-ahead", "runtime/decoding/methods.py",
             'return 0 if spec.admit == "none" or not self.prefetch else self.prefetch_slots',
             'return 0 if not self.prefetch else self.prefetch_slots',
             ["tests/test_draft_residency.py", "-k", "settings"], "AR gets prefetch slots it never uses"),
    Mutation("prefetch-evicts-draft-experts", "runtime/offload/cache.py",
             'if self.phase == "draft" and self.prefetch_slots:', 'if False:',
             ["tests/test_offload.py", "-k", "draft_used"], "a prefetch evicts an expert the draft is routing among"),
    Mutation("prefetch-failed-read-keeps-room", "runtime/offload/cache.py",
             "                    self._release(key)  # a prefetch's room: the read below takes it (or fails)\n", "",
             ["tests/test_offload.py", "-k", "holds_its_room"], "a prefetched read that fails keeps its room forever"),
    Mutation("settle-drops-running-guess", "runtime/offload/cache.py",
             "            if hasattr(future, \"done\") and not future.done() and future.cancel():",
             "            if hasattr(future, \"done\") and not future.done():\n                future.cancel()",
             ["tests/test_offload.py", "-k", "holds_its_room"], "a guess still being read is dropped: its buffer lands outside the budget"),
    Mutation("device-prefetch-staging-unplanned", "runtime/engine.py",
             "staged_prefetches=slots if backend.on_device else 0)", "staged_prefetches=0)",
             ["tests/test_gpu_standin.py", "-k", "caps_the_device"], "a device backend's prefetch host buffers are outside the plan"),
    Mutation("borrowed-guesses-keep-full-window", "runtime/offload/cache.py",
             "            window = max(1, window - (len(self._borrowed) + 1) // 2)", "            window = window",
             ["tests/test_offload.py", "-k", "streaming_workspace"], "a pass streams a full window beside guesses held in the workspace: past the plan"),
    Mutation("borrowing-unbounded", "runtime/offload/cache.py",
             "            if borrow and len(self._borrowed) >= self.staging:", "            if False:",
             ["tests/test_draft_residency.py", "-k", "into_the_cache"], "guesses borrow more than the streaming workspace holds"),
    Mutation("missed-refused-counted-as-capped", "runtime/offload/cache.py",
             "            if key in self._refused:\n                st.missed_refused += 1\n",
             "            if False:\n                st.missed_refused += 1\n",
             ["tests/test_offload.py", "-k", "split_by_why"], "verification's misses of refused guesses are blamed on the cap"),
    Mutation("refused-keys-kept-across-iterations", "runtime/offload/cache.py",
             "        self._predicted, self._refused = set(), set()", "        self._predicted = set()",
             ["tests/test_offload.py", "-k", "split_by_why"], "an earlier iteration's refusals are blamed for this one's misses"),
    Mutation("a-window-of-one-lends-its-workspace", "runtime/offload/cache.py",
             "        self.staging = min(self.window, 2 * self.window - 2)", "        self.staging = self.window",
             ["tests/test_offload.py", "-k", "full_workspace"], "a window of 1 lends its workspace to a guess: the pass's read plus its group go past the plan"),
    Mutation("ae-favours-every-tier-expert", "runtime/decoding/speculative.py",
             "        return avail & star", "        return avail",
             ["tests/test_residency_gating.py", "-k", "preferred_set_takes"], "AE prices every resident expert as reused, whatever E* takes at the bonus in use"),
]
