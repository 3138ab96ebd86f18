"""Schedules in the engine: the text form, which rule takes which call (step windows, sigma ranges, kinds,
blocks, roles, passes), counts per rule, tuning and the guard inside a rule, and the configuration."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import schedule as sched
from lib_attn.report import Report
from lib_attn.schedule import ScheduleError, parse
from tests import faulty_backends, tune_backends
from tests.engine_helpers import fresh_engine_with, make_qkv, reference, rel_err


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def self_call(seed=0, n=24):
    return make_qkv(1, 2, n, n, 16, torch.float32, seed=seed)


def cross_call(seed=0):
    return make_qkv(1, 2, 24, 7, 16, torch.float32, seed=seed)


def served(text: str, calls) -> dict:
    """{(label, backend): n} of the calls ``calls()`` makes under schedule ``text``."""
    with lib_attn.use(schedule=text) as cfg, lib_attn.recording() as rec:
        calls()
    assert sum(rec.rules.values()) == rec.total()
    return by_rule(rec, cfg.schedule.text)


def by_rule(rec, text: str) -> dict:
    """{(label, backend): n} of schedule ``text``'s counts in ``rec``, over every role."""
    got: dict = {}
    for (t, label, _, backend), n in rec.rules.items():
        if t == text:
            got[(label, backend)] = got.get((label, backend), 0) + n
    return got


# --- the text form ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, field, value, label", [
    ("0-20%: sdpa", "steps", (0.0, 0.2), "0-20%"),
    ("steps 20 - 80 %: sdpa", "steps", (0.2, 0.8), "20-80%"),
    ("80–100%: sdpa", "steps", (0.8, 1.0), "80-100%"),  # an en dash, as the readout writes it
    ("sigma 0.5-14.6: sdpa", "sigmas", (0.5, 14.6), "sigma 14.6-0.5"),
    ("sigma 14.6-0.5: sdpa", "sigmas", (0.5, 14.6), "sigma 14.6-0.5"),
    ("self: sdpa", "kinds", frozenset({"self"}), "self"),
    ("cross: sdpa", "kinds", frozenset({"cross"}), "cross"),
    ("joint: sdpa", "kinds", frozenset({"joint"}), "joint"),
    ("first 3: sdpa", "blocks", ("first", 3), "first 3"),
    ("last 2: sdpa", "blocks", ("last", 2), "last 2"),
    ("blocks 4-6: sdpa", "blocks", ("range", 4, 6), "blocks 4-6"),
    ("unet: sdpa", "roles", frozenset({"unet"}), "unet"),
    ("dit: sdpa", "roles", frozenset({"dit"}), "dit"),
    ("vae: sdpa", "roles", frozenset({"vae"}), "vae"),
    ("base: sdpa", "passes", frozenset({"base"}), "base"),
    ("hires: sdpa", "passes", frozenset({"hires"}), "hires"),
    ("refiner: sdpa", "passes", frozenset({"refiner"}), "refiner"),
])
def test_every_condition_kind_parses(text, field, value, label):
    (rule,) = parse(text).rules
    assert getattr(rule, field) == value and rule.label == label and rule.chain == ("sdpa",)
    assert rule.roles == (frozenset({"vae"}) if label == "vae" else frozenset({label}) if label in ("unet", "dit")
                          else sched.DENOISER)


def test_canonical_text_and_its_round_trip():
    s = parse("  refiner CROSS steps 0 - 50 %: math , sdpa, math ;; first 2 self: auto\n vae: sdpa-math ")
    assert s.text == "0-50% cross refiner: math, sdpa; first 2 self: auto; vae: sdpa-math"
    assert [r.chain for r in s.rules] == [("math", "sdpa"), None, ("sdpa-math",)]
    assert [r.index for r in s.rules] == [0, 1, 2] and s.asks_step and s.asks_blocks and not s.asks_sigma
    again = parse(s.text)
    assert again == s and again.text == s.text and parse(s) is s
    plain = parse("cross: math; vae: sdpa")
    assert not (plain.asks_step or plain.asks_sigma or plain.asks_blocks)
    assert parse("sigma 14-1: math").asks_sigma and parse("joint: math").asks_blocks


@pytest.mark.parametrize("text", [None, "", "   ", ";", " ; \n ", "off", "OFF", "none", " None "])
def test_no_schedule(text):
    assert parse(text) is None
    lib_attn.configure(schedule="0-50%: math")
    lib_attn.configure(schedule=text if text is not None else "")
    assert lib_attn.config().schedule is None


@pytest.mark.parametrize("text, message", [
    ("0-50% sdpa", "schedule rule 1 ('0-50% sdpa'): no ':' between conditions and backends; a rule reads like "
                   "'20-80%: sage'"),
    ("0-50%: sdpa; : math", "schedule rule 2 (': math'): no condition before ':'; valid conditions: A-B% (steps done), "
                            "sigma X-Y, self, cross, joint, first N, last N, blocks A-B, unet, dit, vae, base, hires, refiner"),
    ("halfway: sdpa", "schedule rule 1 ('halfway: sdpa'): 'halfway' is not a condition; valid conditions: A-B%"),
    ("0-50%: sdpa, fastest", "schedule rule 1 ('0-50%: sdpa, fastest'): unknown backend id 'fastest'; valid ids: "
                             "flash-attn, "),
    ("0-50%: sdpa, fastest", ", sdpa, sdpa-math, math, sdpa-host, or auto"),
    ("0-50%:  ", "schedule rule 1 ('0-50%:'): no backend after ':'; write backend ids (e.g. sdpa, sage) or auto"),
    ("50-20%: sdpa", "step window '50-20%' must run from a lower to a higher percentage within 0-100%"),
    ("0-120%: sdpa", "step window '0-120%' must run from a lower to a higher percentage within 0-100%"),
    ("0-20% 20-40%: sdpa", "more than one step window in one rule"),
    ("first 2 last 2: sdpa", "more than one block condition in one rule"),
    ("first 0: sdpa", "'first 0' names no block; write first N with N >= 1"),
    ("blocks 5-3: sdpa", "block range 'blocks 5-3' must run from the lower index to the higher"),
    ("vae 0-50%: sdpa", "'vae' cannot be combined with steps; write a separate 'vae: ...' rule"),
    ("vae cross: sdpa", "'vae' cannot be combined with cross"),
    ("cross: sdpa; cross: math", "schedule rule 2 ('cross: math'): same conditions as rule 1 ('cross'), which takes "
                                 "every call this one would: join their backends in one rule"),
])
def test_each_mistake_names_the_rule_the_part_and_what_is_valid(text, message):
    with pytest.raises(ScheduleError) as exc:
        parse(text)
    assert message in str(exc.value)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("text, shadowed, by", [
    ("0-50%: sdpa; 10-20% cross: sage", 2, "rule 1 ('0-50%') takes"),
    ("self: sdpa; self 0-20%: sage", 2, "rule 1 ('self') takes"),
    ("first 4: sdpa; blocks 0-2 cross: sage", 2, "rule 1 ('first 4') takes"),
    ("0-50%: sdpa; 40-100%: sage; 50-90% cross: math", 3, "rule 2 ('40-100%') takes"),
    ("0-30%: sdpa; 30-60%: math; 60-100% cross: sage; 20-70% cross: sdpa-math", 4,
     "rule 1 ('0-30%'), rule 2 ('30-60%') and rule 3 ('60-100% cross') take"),
    ("sigma 0-20: sdpa; sigma 1-5 hires: sage", 2, "rule 1 ('sigma 20-0') takes"),
    ("unet: sdpa; unet cross: sage", 2, "rule 1 ('unet') takes"),
    # several earlier rules that between them take every call of a later one
    ("self: sdpa; cross: sage; unet: math", 3, "rule 1 ('self') and rule 2 ('cross') take"),
    ("unet: sdpa; dit: sage; self: math", 3, "rule 1 ('unet') and rule 2 ('dit') take"),
    ("sigma 14-3: sdpa; sigma 3-0: sage; sigma 10-1 cross: math", 3,
     "rule 1 ('sigma 14-3') and rule 2 ('sigma 3-0') take"),
    ("first 2: sdpa; blocks 2-5: sage; blocks 1-4 cross: math", 3, "rule 1 ('first 2') and rule 2 ('blocks 2-5') take"),
    ("base: sdpa; hires: sage; base hires: math", 3, "rule 1 ('base') and rule 2 ('hires') take"),
    ("0-50%: sdpa; 50-100% self: sage; 50-100% cross: math; 60-90% unet: sdpa-math", 4,
     "rule 2 ('50-100% self') and rule 3 ('50-100% cross') take"),
    # a rule with no window: the windowed rule takes its calls at a known step, rule 2 the others
    ("0-100%: sdpa; unet: sage; unet self: math", 3, "rule 1 ('0-100%') and rule 2 ('unet') take"),
])
def test_a_rule_earlier_rules_always_take_first_is_refused_naming_them(text, shadowed, by):
    with pytest.raises(ScheduleError) as exc:
        parse(text)
    assert str(exc.value).startswith(f"schedule rule {shadowed} (")
    assert f"never holds: {by} every call it would first; move it before rule " in str(exc.value)


@pytest.mark.parametrize("text", [
    "cross: sdpa; 0-20%: sdpa; 20-80%: sage3, sage; 80-100%: sdpa; vae: sdpa-efficient",
    "0-50%: sdpa; 40-100% cross: sage", "0-30%: sdpa; 40-100%: math; 20-50%: sage",  # a gap from 30 to 40%
    "cross: sdpa; 25-75% self: sage; vae: sdpa-efficient", "first 2: auto; last 2: auto; hires: sdpa; 10-90%: sage",
    "first 2: sdpa; blocks 1-3: sage", "hires: sdpa; 0-50%: sage", "unet: sdpa; dit cross: sage; self: math",
    "self: sdpa; cross: sage; dit: math",                              # a DiT's joint calls reach rule 3
    "sigma 14-4: sdpa; sigma 3-0: sage; sigma 10-1: math",             # sigmas between 3 and 4 reach rule 3
    "first 2: sdpa; blocks 3-5: sage; blocks 1-4: math",               # block 2 reaches rule 3
    "last 1: sdpa; last 2 cross: sage; first 1: math",                 # how many blocks: the model says
    "base: sdpa; hires: sage; refiner: math; self: sdpa-math",         # calls of a pass no host named
    "0-50%: sdpa; 50-100% self: sage; 50-100% cross: math; 60-90%: sdpa-math",  # joint calls at 60-90%
])
def test_rules_that_some_call_reaches_are_kept(text, caplog):
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        assert parse(text).text
    assert not caplog.records


def test_a_rule_with_no_window_behind_windows_that_cover_every_step_is_kept_with_a_warning(caplog):
    text = "0-20%: sdpa; 20-80%: math; 80-100%: sdpa; cross: sdpa-math"
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        lib_attn.configure(preference=["sdpa"], schedule=text)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("schedule rule 4 ('cross: sdpa-math') takes only calls made where no sampling step is known: "
                    "rule 1 ('0-20%'), rule 2 ('20-80%') and rule 3 ('80-100%') take every call of it at a known step "
                    "first; move it before rule 1 for it to hold while sampling")

    def calls():
        sched.leave()
        lib_attn.attention(*cross_call())  # outside sampling: the rule holds, as the warning says
        for step in range(10):
            sched.at_step(step, 10)
            lib_attn.attention(*cross_call())
    got = served(text, calls)
    assert got == {("cross", "sdpa-math"): 1, ("0-20%", "sdpa"): 2, ("20-80%", "math"): 6, ("80-100%", "sdpa"): 2}


def test_the_warning_names_one_shadowing_rule_in_the_singular(caplog):
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        parse("0-100%: sdpa; cross: math")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("schedule rule 2 ('cross: math') takes only calls made where no sampling step is known: rule 1 "
                    "('0-100%') takes every call of it at a known step first; move it before rule 1 for it to hold "
                    "while sampling")


def test_a_rule_with_no_window_behind_kinds_whose_windows_cover_every_step_is_kept_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        parse("0-100% self: sdpa; 0-100% cross: sage; unet: math")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("schedule rule 3 ('unet: math') takes only calls made where no sampling step is known: rule 1 "
                    "('0-100% self') and rule 2 ('0-100% cross') take every call of it at a known step first; move it "
                    "before rule 1 for it to hold while sampling")


def test_the_schedules_pages_examples_parse_with_no_rule_shadowed(caplog):
    import os
    import re
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "schedules.md"),
                encoding="utf-8").read()
    block = re.search(r"configuration \(backend setting, flags, Auto\):\n\n```\n(.*?)```", page, re.S)[1]
    examples = [line for line in block.splitlines() if line.strip()]
    assert len(examples) == 3
    with caplog.at_level(logging.WARNING, logger="lib_attn"):
        for text in examples:
            assert parse(text).text == text  # each is in canonical form, as the readout writes it
    assert not caplog.records


def test_a_schedule_that_is_not_text_is_refused():
    with pytest.raises(ScheduleError, match="a schedule is text such as '0-20%: sdpa; 20-80%: sage; 80-100%: sdpa', "
                                            "got list"):
        parse(["0-50%: sdpa"])


def test_a_bad_schedule_leaves_the_configuration_unchanged():
    lib_attn.configure(preference=["sdpa-math"], schedule="cross: math")
    before = lib_attn.config()
    for bad in ("0-50%: nope", "0-50% math"):
        with pytest.raises(ScheduleError):
            lib_attn.configure(preference=["math"], guard="off", schedule=bad)
        with pytest.raises(ScheduleError):
            with lib_attn.use(preference=["math"], schedule=bad):
                pass
    assert lib_attn.config() is before
    assert before.preference["unet"] == ("sdpa-math",) and before.schedule.text == "cross: math"
    assert sched.where.schedule is before.schedule


# --- which rule takes a call ------------------------------------------------------------------------

def test_the_first_rule_that_holds_takes_the_call_and_the_rest_keep_the_configuration():
    lib_attn.configure(preference=["sdpa-math"])

    def calls():
        for step in (1, 6):  # of 10: 10% and 60%
            sched.at_step(step, 10)
            lib_attn.attention(*cross_call())
            lib_attn.attention(*self_call())
    got = served("cross: math; 0-50%: sdpa; 0-100%: sdpa-flash", calls)
    # A cross call at 10% meets "cross" and "0-50%": the first wins. At 60% the self call falls to the third.
    assert got == {("cross", "math"): 2, ("0-50%", "sdpa"): 1, ("0-100%", "sdpa-flash"): 1}
    got = served("0-50%: sdpa", calls)
    assert got == {("0-50%", "sdpa"): 2, (sched.OTHERWISE, "sdpa-math"): 2}  # the configured chain


def test_window_edges():
    def at(step, total):
        def calls():
            sched.at_step(step, total)
            lib_attn.attention(*self_call())
        return calls
    text = "0-50%: math; 50-90%: sdpa; 90-100%: sdpa-math"
    assert served(text, at(0, 10)) == {("0-50%", "math"): 1}
    assert served(text, at(4, 10)) == {("0-50%", "math"): 1}
    assert served(text, at(5, 10)) == {("50-90%", "sdpa"): 1}  # [A, B): 50% belongs to the second window
    assert served(text, at(9, 10)) == {("90-100%", "sdpa-math"): 1}  # the last step is in the window up to 100%
    assert served(text, at(10, 10)) == {("90-100%", "sdpa-math"): 1}  # and so is a host's "all steps done"
    assert served("0-50%: math", at(None, None)) == {(sched.OTHERWISE, "sdpa"): 1}  # no step known: no window holds


def test_sigma_ranges_include_both_ends_and_need_a_sigma():
    def at(sigma):
        def calls():
            sched.at_step(3, 10, sigma=sigma)
            lib_attn.attention(*self_call())
        return calls
    text = "sigma 14.6-1: math"
    assert served(text, at(14.6)) == {("sigma 14.6-1", "math"): 1}
    assert served(text, at(1.0)) == {("sigma 14.6-1", "math"): 1}
    assert served(text, at(0.99)) == {(sched.OTHERWISE, "sdpa"): 1}
    assert served(text, at(None)) == {(sched.OTHERWISE, "sdpa"): 1}


def test_passes():
    def calls():
        for name in ("base", "hires", None):
            sched.at_step(0, 10, pass_name=name)
            lib_attn.attention(*self_call())
    assert served("hires: math; base 0-50%: sdpa-math", calls) == {
        ("hires", "math"): 1, ("0-50% base", "sdpa-math"): 1, (sched.OTHERWISE, "sdpa"): 1}


def test_roles_a_rule_without_one_is_for_the_denoiser():
    def calls():
        sched.at_step(0, 10)
        for role in ("unet", "dit", "vae", "text"):
            lib_attn.attention(*self_call(), role=role)
    assert served("0-50%: math; vae: sdpa-math", calls) == {
        ("0-50%", "math"): 2, ("vae", "sdpa-math"): 1, (sched.OTHERWISE, "sdpa"): 1}
    assert served("dit: math", calls) == {("dit", "math"): 1, (sched.OTHERWISE, "sdpa"): 3}


@pytest.mark.parametrize("role, q, kv, joint, want", [
    ("unet", 64, 77, False, "cross"), ("unet", 64, 64, False, "self"), ("dit", 64, 77, True, "cross"),
    ("dit", 64, 64, True, "joint"), ("dit", 64, 64, False, "self"), ("unet", 64, 64, True, "self"),
])
def test_kind_from_shapes(role, q, kv, joint, want):
    assert sched.kind(role, q, kv, joint) == want


# --- blocks -----------------------------------------------------------------------------------------

class Attend(torch.nn.Module):
    """A layer whose forward is one self-attention call through the engine."""

    def __init__(self, role="unet"):
        super().__init__()
        self.role = role

    def forward(self, x):
        return lib_attn.attention(x, x, x, role=self.role)


class LdmUNet(torch.nn.Module):
    """The block lists of an ldm/sgm UNet: input blocks, one middle block (a Sequential of layers), output blocks."""

    def __init__(self):
        super().__init__()
        self.input_blocks = torch.nn.ModuleList([Attend() for _ in range(3)])
        self.middle_block = torch.nn.Sequential(Attend(), Attend())
        self.output_blocks = torch.nn.ModuleList([Attend() for _ in range(3)])

    def forward(self, x):
        for block in (*self.input_blocks, self.middle_block, *self.output_blocks):
            x = block(x)
        return x


def test_block_hooks_number_the_blocks_and_the_middle_block_is_one():
    model = LdmUNet()
    x = self_call()[0]
    with lib_attn.use(schedule="first 2: math; blocks 3-3: sdpa-math; last 3: sdpa-flash; 0-100%: sdpa") as cfg, \
            sched.blocks(model) as total, lib_attn.recording() as rec:
        assert total == 7
        sched.at_step(0, 1)
        model(x)
    got = by_rule(rec, cfg.schedule.text)
    # blocks 0, 1: first 2; block 2: the step rule; block 3 (both middle layers); blocks 4-6: last 3
    assert got == {("first 2", "math"): 2, ("0-100%", "sdpa"): 1, ("blocks 3-3", "sdpa-math"): 2,
                   ("last 3", "sdpa-flash"): 3}
    assert sum(rec.rules.values()) == rec.total() == 8 and cfg.schedule.text.startswith("first 2")


def test_block_hooks_go_with_the_scope():
    model = LdmUNet()
    with sched.blocks(model):
        assert all(len(b._forward_pre_hooks) == 1 for b in (*model.input_blocks, model.middle_block))
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_model_without_known_blocks_yields_none_and_block_rules_never_hold():
    model = torch.nn.Sequential(Attend(), Attend())
    with lib_attn.use(schedule="first 1: math"), sched.blocks(model) as total, lib_attn.recording() as rec:
        sched.at_step(0, 1)
        model(self_call()[0])
    assert total == 0
    assert {label for (_, label, _, _) in rec.rules} == {sched.OTHERWISE}


def test_joint_blocks_make_their_self_shaped_calls_joint():
    class MMDiT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.joint_blocks = torch.nn.ModuleList([Attend("dit"), Attend("dit")])

        def forward(self, x):
            for block in self.joint_blocks:
                x = block(x)
            return x
    model = MMDiT()
    with lib_attn.use(schedule="joint: math; self: sdpa-math"), sched.blocks(model), lib_attn.recording() as rec:
        sched.at_step(0, 1)
        model(self_call()[0])
    assert by_rule(rec, "joint: math; self: sdpa-math") == {("joint", "math"): 2}


def test_transformer_blocks_are_joint_only_in_the_joint_models():
    blocks = torch.nn.ModuleList([torch.nn.Identity()])
    for name, joint in (("SD3Transformer2DModel", True), ("FluxTransformer2DModel", True),
                        ("DiTTransformer2DModel", False)):
        model = type(name, (torch.nn.Module,), {})()
        model.transformer_blocks = blocks
        assert sched.block_modules(model) == [(blocks[0], joint)]


# --- counts, tuning and the guard inside a rule -------------------------------------------------------

def test_counts_per_rule_add_up_over_a_sampling_loop():
    """20 steps of a 7-block UNet with a cross-attention call in each input block, and the VAE."""
    model = LdmUNet()
    q, k, v = cross_call()
    for block in model.input_blocks:
        block.register_forward_pre_hook(lambda m, a: lib_attn.attention(q, k, v))
    # "cross" first: after the step windows, which hold for every call of their steps, it would take nothing.
    text = "cross: math; 0-20%: sdpa; 20-80%: sdpa-math; 80-100%: sdpa; vae: sdpa-flash"
    with lib_attn.use(schedule=text), sched.blocks(model), lib_attn.recording() as rec:
        for step in range(20):
            sched.at_step(step, 20)
            model(self_call()[0])
        sched.leave()
        lib_attn.attention(*self_call(n=40), role="vae")
    got = by_rule(rec, text)
    # per step: 7 self calls (the middle block's two layers: 8) and 3 cross calls; steps 0-3, 4-15, 16-19
    assert got == {("0-20%", "sdpa"): 4 * 8, ("20-80%", "sdpa-math"): 12 * 8, ("80-100%", "sdpa"): 4 * 8,
                   ("cross", "math"): 20 * 3, ("vae", "sdpa-flash"): 1}
    assert sum(rec.rules.values()) == rec.total() == 20 * 11 + 1


def test_the_output_is_the_kernels_own_in_every_window():
    q, k, v = make_qkv(2, 4, 32, 32, 16, torch.float64, seed=4)
    want = reference(q, k, v)
    with lib_attn.use(schedule="0-50%: math; 50-100%: sdpa-math"), lib_attn.recording() as rec:
        for step in range(4):
            sched.at_step(step, 4)
            assert rel_err(lib_attn.attention(q, k, v), want) < 1e-12
    assert set(rec.calls) == {("unet", "math"), ("unet", "sdpa-math")}


def test_the_guard_catches_a_faulty_backend_named_in_a_rule(monkeypatch, tmp_path):
    with fresh_engine_with(monkeypatch, tmp_path, faulty_backends):
        text = "0-50%: fk-nan; 50-100%: sdpa-math"
        with lib_attn.use(schedule=text), lib_attn.recording() as rec:
            outs = []
            for step in range(4):
                sched.at_step(step, 4)
                q, k, v = self_call(seed=step)
                outs.append((lib_attn.attention(q, k, v), F.scaled_dot_product_attention(q, k, v)))
        assert all(torch.equal(a, b) for a, b in outs[:2])  # recomputed on the default chain's sdpa
        assert all(rel_err(a, b) < 1e-6 for a, b in outs[2:])
        assert faulty_backends.CALLS["fk-nan"] == 1  # caught once; the signature is then the next backend's
        ((role, caught, said, ran_on, recomputed), n), = rec.guard.items()
        assert (role, caught, ran_on, recomputed, n) == ("unet", "fk-nan", "sdpa", True, 1)
        assert "non-finite" in said
        assert by_rule(rec, text) == {("0-50%", "sdpa"): 2, ("50-100%", "sdpa-math"): 2}


def test_tuning_ranks_the_chain_a_rule_names(monkeypatch, tmp_path):
    with fresh_engine_with(monkeypatch, tmp_path, tune_backends):
        lib_attn.configure(tune="on")
        text = "0-50%: tt-slow, tt-quick; 50-100%: tt-slow"
        with lib_attn.use(schedule=text), lib_attn.recording() as rec:
            for step in range(4):
                sched.at_step(step, 4)
                lib_attn.attention(*self_call(seed=step))
        got = by_rule(rec, text)
        # the first window's two backends are measured and the faster serves; a single backend is never second-guessed
        assert got == {("0-50%", "tt-quick"): 2, ("50-100%", "tt-slow"): 2}
        sched.at_step(0, 4)
        with lib_attn.use(schedule=text):
            assert lib_attn.explain(*self_call()).source in ("measured", "stored")


# --- the report ---------------------------------------------------------------------------------------

def test_rules_survive_the_reports_json_round_trip():
    text = "0-50%: math; 50-100%: sdpa-math; vae: sdpa"

    def calls():
        for step in range(4):
            sched.at_step(step, 4)
            lib_attn.attention(*self_call())
        lib_attn.attention(*self_call(), role="vae")
        lib_attn.attention(*self_call(), role="text")
    with lib_attn.use(schedule=text), lib_attn.recording() as rec:
        calls()
    report = Report.from_recording(rec)
    data = json.loads(report.to_json())
    assert data["schedule"] == text
    again = Report.from_dict(data)
    assert again.rules == report.rules == dict(rec.rules)
    assert again.rule_items(text) == report.rule_items(text) == [
        ("0-50%", [("unet", "math", 2)]), ("50-100%", [("unet", "sdpa-math", 2)]), ("vae", [("vae", "sdpa", 1)]),
        (sched.OTHERWISE, [("text", "sdpa", 1)])]
