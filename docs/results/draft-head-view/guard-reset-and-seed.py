"""s2moe CLI with AE's acceptance model seeded at the first generate (SEED=tokens) by an eager ca+ae run."""
import os, sys, json
from s2moe.runtime.decoding import speculative as _sp
from s2moe.runtime.decoding import rate_guard as _rg
from s2moe.runtime.decoding.methods import get_method
from s2moe.runtime.decoding.cost_model import CostConstants
EAGER = CostConstants(t_ar=50.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
N = int(os.environ.get("SEED", "0"))
_gen = _sp.SpeculativeDecoder.generate
def generate(self, prompt, max_tokens, *a, **k):
    if N and self.acceptance is not None and self.live is not None and not getattr(self, "_seeded", False):
        self._seeded = True
        helper = _sp.SpeculativeDecoder(self.model, get_method("ca+ae", reuse_gating=False), self.settings, EAGER)
        _gen(helper, list(prompt), N)
        self.acceptance.accepted += helper.acceptance.accepted
        self.acceptance.drafted += helper.acceptance.drafted
        self.acceptance._sums = None
        print("seeded", helper.acceptance.table(), file=sys.stderr)
    if os.environ.get("RESET") and self.guard is not None:
        g = self.guard
        g.hold, g.next_hold = 0, g.BASE_HOLD
        g.spec = _rg._Rate(g.spec.decay)
    return _gen(self, prompt, max_tokens, *a, **k)
_sp.SpeculativeDecoder.generate = generate
from s2moe.runtime.decoding import rate_guard as _rg
_o = _rg.RateGuard.observe
_f = open(os.environ.get("GUARDLOG","/dev/null"), "a")
def obs(self, sp, tok, sec, expected=None):
    before = (self.hold, self.next_hold, self.spec.value, self.ar.value)
    _o(self, sp, tok, sec, expected)
    _f.write(json.dumps({"id": id(self), "sp": sp, "tok": tok, "exp": expected, "sec": sec, "hold_after": self.hold,
                         "spec": self.spec.value, "ar": self.ar.value, "held": self.held_steps}) + "\n")
_rg.RateGuard.observe = obs
if os.environ.get("PROBEDRAFT"):
    _s3, _o3 = _rg.RateGuard.speculate, _rg.RateGuard.observe
    def spec3(self):
        was = self.hold > 0
        r = _s3(self)
        if was and self.hold == 0:
            self._after_hold = True
        return r
    def obs3(self, sp, tok, sec, expected=None):
        if sp and getattr(self, "_after_hold", False):
            self._after_hold = False
            if expected is not None and abs(expected - 1.0) < 1e-9:
                keep = (self.hold, self.next_hold, self.holds)
                _o3(self, sp, tok, sec, expected)
                self.hold, self.next_hold, self.holds = keep
                return
        _o3(self, sp, tok, sec, expected)
    _rg.RateGuard.speculate, _rg.RateGuard.observe = spec3, obs3
if os.environ.get("NOEMPTY"):
    _o2 = _rg.RateGuard.observe
    def obs2(self, sp, tok, sec, expected=None):
        if sp and expected is not None and abs(expected - 1.0) < 1e-9:
            keep = (self.hold, self.next_hold, self.holds)
            _o2(self, sp, tok, sec, expected)
            self.hold, self.next_hold, self.holds = keep
            return
        _o2(self, sp, tok, sec, expected)
    _rg.RateGuard.observe = obs2
from s2moe.runtime.cli import main
sys.argv = ['s2moe'] + sys.argv[1:]
main()
