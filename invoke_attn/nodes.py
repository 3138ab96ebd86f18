"""The nodes: Attention backend (the configuration of a session's attention, passing models on) and
Attention report (what the session's attention did).

InvokeAI names a node's pack after the first part of its class's module, so ``startup`` loads this
file as a module of the pack's own package; it imports the rest of the extension by absolute name.
The choices list only valid values; the chains, the schedule and the sparse settings typed by hand are
checked when the graph is enqueued, so that a bad one is refused with InvokeAI's validation error naming the field
and saying what is wrong, before anything runs.
"""
import typing
from typing import Optional

from pydantic import field_validator

from invokeai.invocation_api import (BaseInvocation, BaseInvocationOutput, ImageField, Input, InputField,
                                     InvocationContext, OutputField, TransformerField, UNetField, VAEField,
                                     invocation, invocation_output)

import lib_attn
from lib_attn import schedule as schedules
from lib_attn import sparse as sparse_settings
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES

from lib_attn import readout
from host_attn.node_options import (AUTO, CHAIN_TOOLTIP, FP32_TOOLTIP, GUARD_TOOLTIP, STRICT_TOOLTIP, TUNE_TOOLTIP,
                                    backend_choices, backend_tooltip, problem, schedule_tooltip,
                                    sparse_tooltip)
from invoke_attn import choices, sessions

try:
    from invokeai.app.invocations.model import WanTransformerField
except ImportError:  # a release without Wan
    WanTransformerField = None

BACKEND_TYPE = "flash_attention_backend"
REPORT_TYPE = "flash_attention_report"
#: The nodes' versions: a new input is a minor version (``sparse`` in 1.1.0), so that InvokeAI offers "Update Node"
#: for a node saved in a workflow by an earlier release instead of showing the input as missing.
BACKEND_VERSION = "1.1.0"
REPORT_VERSION = "1.0.0"
CATEGORY = "attention"
TAGS = ["attention", "flash-attn", "sage", "sdpa"]

Backend = typing.Literal[tuple(backend_choices())]
Guard = typing.Literal[GUARD_MODES]
Tune = typing.Literal[TUNE_MODES]
Fp32 = typing.Literal[(AUTO, *FP32_POLICIES)]


@invocation_output("flash_attention_backend_output")
class AttentionBackendOutput(BaseInvocationOutput):
    """The models given to the Attention backend node, passed on."""

    unet: Optional[UNetField] = OutputField(default=None, title="UNet", description="The UNet, passed on")
    transformer: Optional[TransformerField] = OutputField(default=None, title="Transformer",
                                                          description="The transformer, passed on")
    if WanTransformerField is not None:
        wan_transformer: Optional[WanTransformerField] = OutputField(default=None, title="Wan Transformer",
                                                                     description="The Wan transformer, passed on")
    vae: Optional[VAEField] = OutputField(default=None, title="VAE", description="The VAE, passed on")


@invocation(BACKEND_TYPE, title="Attention backend", tags=TAGS, category=CATEGORY, version=BACKEND_VERSION)
class AttentionBackendInvocation(BaseInvocation):
    """Runs attention on the fastest kernel that takes each call, falling back per call with the reason.
    Connect models through it to route the nodes that use them; unconnected, it routes the whole graph."""

    unet: Optional[UNetField] = InputField(default=None, input=Input.Connection, title="UNet",
                                           description="A UNet (SD1.5, SDXL) to route")
    transformer: Optional[TransformerField] = InputField(default=None, input=Input.Connection, title="Transformer",
                                                         description="A transformer (FLUX, SD3, Qwen-Image, ...) to route")
    if WanTransformerField is not None:
        wan_transformer: Optional[WanTransformerField] = InputField(default=None, input=Input.Connection,
                                                                    title="Wan Transformer",
                                                                    description="A Wan transformer to route")
    vae: Optional[VAEField] = InputField(default=None, input=Input.Connection, title="VAE",
                                         description="A VAE to route")
    backend: Backend = InputField(default=AUTO, description=backend_tooltip())
    chain: str = InputField(default="", description=CHAIN_TOOLTIP)
    vae_chain: str = InputField(default="", title="VAE Chain",
                                description="Optional: the VAE's chain of backend ids (empty: Auto)")
    guard: Guard = InputField(default=GUARD_MODES[0], description=GUARD_TOOLTIP)
    schedule: str = InputField(default="", description=schedule_tooltip(choices.ENV_SCHEDULE))
    sparse: str = InputField(default="", description=sparse_tooltip(choices.ENV_SPARSE))
    strict: bool = InputField(default=False, description=STRICT_TOOLTIP)
    fp32: Fp32 = InputField(default=AUTO, title="FP32", description=FP32_TOOLTIP)
    tune: Tune = InputField(default=TUNE_MODES[0], description=TUNE_TOOLTIP)

    @field_validator("chain", "vae_chain")
    @classmethod
    def _known_ids(cls, value: str) -> str:
        wrong = problem(value)
        if wrong:
            raise ValueError(wrong)
        return value

    @field_validator("schedule")
    @classmethod
    def _parses(cls, value: str) -> str:
        schedules.parse(value or None)  # ScheduleError (a ValueError) names the rule and the part
        return value

    @field_validator("sparse")
    @classmethod
    def _sparse_parses(cls, value: str) -> str:
        sparse_settings.parse(value or None)  # SparseError (a ValueError) names the value and the valid ones
        return value

    def choice(self, node_id: str | None = None) -> choices.Choice:
        """This node's choice, said to come from node ``node_id`` (the graph's id of a prepared copy)."""
        return choices.choice(self.backend, self.chain, self.vae_chain, self.guard, self.schedule, self.strict,
                              self.fp32, self.tune, said_by=f"node {node_id or self.id}", sparse=self.sparse)

    def invoke(self, context: InvocationContext) -> AttentionBackendOutput:
        passed = {"unet": self.unet, "transformer": self.transformer, "vae": self.vae}
        if WanTransformerField is not None:
            passed["wan_transformer"] = self.wan_transformer
        return AttentionBackendOutput(**passed)


@invocation_output("flash_attention_report_output")
class AttentionReportOutput(BaseInvocationOutput):
    """What the session's attention did, and the image, passed on."""

    report: str = OutputField(description="Which kernels ran, how often, what fell back and why, time and VRAM")
    image: ImageField = OutputField(description="The image, passed on")


@invocation(REPORT_TYPE, title="Attention report", tags=TAGS, category=CATEGORY, version=REPORT_VERSION, use_cache=False)
class AttentionReportInvocation(BaseInvocation):
    """The attention readout of this session so far: connect the decoded image to read it after the decode."""

    image: ImageField = InputField(input=Input.Connection, description="An image of this session (to run after it)")

    def invoke(self, context: InvocationContext) -> AttentionReportOutput:
        session = sessions.of(context, BACKEND_TYPE)
        if session is None:
            report = lib_attn.Report(ran_on=sessions.OWN_ATTENTION, notes=(
                f"nothing in this session is routed: add an Attention backend node, or set {choices.ENV_ROUTE}",))
        else:
            report = session.report()
        text = readout.text(report)
        context.logger.info(f"Attention report:\n{text}")
        return AttentionReportOutput(report=text, image=self.image)
