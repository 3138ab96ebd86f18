"""Where A1111 and the Forge lines are in sampling, told to the engine's schedule.

Every one of these webuis calls the ``cfg_denoiser`` callbacks once per denoiser call, before the model
runs, with ``CFGDenoiserParams(x, image_cond, sigma, sampling_step, total_sampling_steps, text_cond,
text_uncond, denoiser)``; the ``denoiser`` (their ``CFGDenoiser``) holds the generation's ``p``, its own
count of calls (``step``) and the calls its sampler is expected to make (``total_steps``). Its
``sampling_step`` is the webui's progress counter, which the sampler's per-step callback sets after each
step: during step i it still says i-1, so the denoiser's own count is the one used. A hires fix pass
runs a sampler of its own: its count starts again at 0.

A ``Follower`` exists only while a schedule or sparse attention is in force; per denoiser call it costs a
few attribute reads, one ``sigma`` read from the device only when a rule asks for sigmas, and, when a rule
asks for blocks or sparse attention is on, an identity check of the running model (the refiner swaps it).
"""
from __future__ import annotations

import contextlib

from lib_attn import schedule as schedules

from . import text as joint_text


def progress(params) -> tuple:
    """(step, total) of the pass: the denoiser's own count where it has one, else the webui's."""
    denoiser = getattr(params, "denoiser", None)
    step, total = getattr(denoiser, "step", None), getattr(denoiser, "total_steps", None)
    if isinstance(step, int) and total:
        return step, total
    return getattr(params, "sampling_step", None), getattr(params, "total_sampling_steps", None)


def sigma_of(params) -> float | None:
    """The call's sigma (a device read). The timestep samplers (DDIM, PLMS, UniPC) pass a timestep
    there, which their denoiser's ``alphas`` (the model's cumulative alphas) turn into a sigma."""
    value = getattr(params, "sigma", None)
    if value is None:
        return None
    first = value.reshape(-1)[0] if hasattr(value, "reshape") else value
    alphas = getattr(getattr(params, "denoiser", None), "alphas", None)
    if alphas is not None:
        return schedules.sigma_of_alpha_bar(float(alphas[int(first)]))
    return float(first)


def pass_name(p, shared) -> str:
    """``refiner`` once the webui has switched to the refiner's checkpoint (``apply_refiner`` does that
    before the callback), ``hires`` in the hires fix pass, else ``base``."""
    refiner = getattr(p, "refiner_checkpoint_info", None)
    if refiner is not None and getattr(getattr(shared, "sd_model", None), "sd_checkpoint_info", None) == refiner:
        return "refiner"
    return "hires" if getattr(p, "is_hr_pass", False) else "base"


def running_denoiser(shared):
    """The denoiser module sampling runs now: the Forge lines' ``forge_objects.unet.model.diffusion_model``,
    A1111's ``sd_model.model.diffusion_model``; None when neither is there."""
    model = getattr(shared, "sd_model", None)
    forge = getattr(model, "forge_objects", None)
    if forge is not None:
        model = getattr(getattr(forge, "unet", None), "model", None)
    else:
        model = getattr(model, "model", None)
    return getattr(model, "diffusion_model", None)


class Follower:
    """One generation's sampling position, told to ``lib_attn.schedule`` at each denoiser call (``schedule``:
    the rules in force that ask for it, or None), and, with ``text`` (sparse attention on), the running
    model's joint blocks telling their text tokens (``text.told``)."""

    def __init__(self, schedule: schedules.Schedule | None, shared, text: bool = False):
        self.shared = shared
        self.positional = schedule is not None
        self.sigma = self.positional and schedule.asks_sigma
        self.by_block = self.positional and schedule.asks_blocks
        self.text = text
        self.model = None
        self._hooks = contextlib.ExitStack()
        schedules.leave()

    def step(self, params) -> None:
        if self.positional:
            step, total = progress(params)
            sigma = sigma_of(params) if self.sigma else None
            p = getattr(getattr(params, "denoiser", None), "p", None)
            schedules.at_step(step, total, sigma, pass_name(p, self.shared))
        if self.by_block or self.text:
            self.follow(running_denoiser(self.shared))

    def follow(self, model) -> None:
        """Keep the block hooks on ``model``, moving them when the webui swapped models."""
        if model is self.model:
            return
        self._hooks.close()
        self.model = model
        if model is not None and self.by_block:
            self._hooks.enter_context(schedules.blocks(model))
        if model is not None and self.text:
            self._hooks.enter_context(joint_text.told(model))

    def close(self) -> None:
        self._hooks.close()
        self.model = None
        schedules.leave()
