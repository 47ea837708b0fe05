import random, statistics, sys
sys.path.insert(0, '/work/main')
from s2moe.runtime.decoding.rate_guard import RateGuard

class TrialGuard(RateGuard):
    def __init__(self, trial=3, **kw):
        super().__init__(**kw); self.trial = trial; self._trial = 0; self._was_held = False
    def speculate(self):
        held_before = self.hold > 0
        r = super().speculate()
        if held_before and self.hold == 0 and not r:  # last held step just taken
            self._trial = self.trial
        return r
    def observe(self, speculated, tokens, seconds, expected=None):
        if speculated and self._trial > 0:
            self._trial -= 1
            hold, nh, holds = self.hold, self.next_hold, self.holds
            super().observe(speculated, tokens, seconds, expected)
            self.hold, self.next_hold, self.holds = hold, nh, holds  # no decision inside the trial
            return
        super().observe(speculated, tokens, seconds, expected)

def run(seed, ratios, tokens_per=64, keep=0.72, drafted=5, ar_ms=1.5, guard=None, bias=1.0):
    rng = random.Random(seed)
    mean = sum(keep ** i for i in range(drafted + 1))
    spent = best = 0.0; emitted = ar_steps = 0
    for ratio in ratios:
        e0 = 0
        while e0 < tokens_per:
            if guard.speculate():
                kept = 1
                while kept <= drafted and rng.random() < keep: kept += 1
                s = ratio * ar_ms * mean * rng.uniform(0.8, 1.2) / 1e3
                guard.observe(True, kept, s, mean * bias)
            else:
                kept, s = 1, ar_ms * rng.uniform(0.9, 1.1) / 1e3
                guard.observe(False, 1, s); ar_steps += 1
            spent += s; e0 += kept; best += min(ratio, 1.0) * ar_ms * kept / 1e3
    return spent / best, ar_steps

SCEN = {"flat 0.75": [0.75]*6, "flat 0.87": [0.87]*6, "flat 1.0": [1.0]*6, "flat 1.15": [1.15]*6, "flat 1.4": [1.4]*6,
        "hard first 1.4 then 0.87": [1.4] + [0.87]*5, "hard first 1.4 then 0.75": [1.4]+[0.75]*5,
        "alternating 1.2/0.85": [1.2, 0.85]*3, "easy first 0.87 then 1.3": [0.87] + [1.3]*5}
variants = {"current": lambda: RateGuard(), "trial2": lambda: TrialGuard(2), "trial4": lambda: TrialGuard(4), "trial8": lambda: TrialGuard(8)}
print("| scenario | " + " | ".join(variants) + " |")
for name, ratios in SCEN.items():
    cells = []
    for v, mk in variants.items():
        rs = [run(s, ratios, guard=mk()) for s in range(300)]
        sl = sorted(r[0] for r in rs)
        cells.append("%.3f/%.3f (AR %d)" % (statistics.mean(sl), sl[int(0.9*299)], statistics.median(r[1] for r in rs)))
    print(f"| {name} | " + " | ".join(cells) + " |")
