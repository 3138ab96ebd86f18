"""Double of modules/shared.py: cmd_opts (after every extension's preload), opts with the attention
settings preloaded, and the module globals an attention extension reads (host-contract D1)."""
import datetime
import time

import torch

from modules import options, shared_cmd_options
from modules.options import OptionInfo, options_section  # noqa: F401  (re-exported as in A1111)

parser = shared_cmd_options.parser
cmd_opts = shared_cmd_options.cmd_opts

opts = options.Options({
    "cross_attention_optimization": OptionInfo("Automatic", "Cross attention optimization", None,
                                               section=("optimizations", "Optimizations"), category_id="sd"),
    "upcast_attn": OptionInfo(False, "Upcast cross attention layer to float32", section=("sd", "Stable Diffusion")),
    "memmon_poll_rate": OptionInfo(8, "VRAM usage polls per second during generation.", section=("system", "System")),
    "training_xattention_optimizations": OptionInfo(False, "Use cross attention optimizations while training",
                                                    section=("training", "Training")),
    "send_seed": OptionInfo(True, "Send seed when sending prompt or image to other interface", section=("ui", "User interface")),
    "infotext_skip_pasting": OptionInfo([], "Disregard fields from pasted infotext", section=("ui", "User interface")),
    "return_grid": OptionInfo(True, "Show grid in gallery", section=("saving-images", "Saving images/grids")),
    "grid_only_if_multiple": OptionInfo(True, "Do not save grids consisting of one picture",
                                        section=("saving-images", "Saving images/grids")),
})

device = torch.device("cpu")
weight_load_location = None

try:
    # Forge: ``modules.shared`` reports Forge's own xformers decision (host-contract B1)
    from backend import memory_management as _memory_management
    xformers_available = _memory_management.xformers_enabled()
except ImportError:
    xformers_available = False

loaded_hypernetworks = []
sd_model = None
mem_mon = None


class State:
    """modules/shared_state.py's State: the flags a job starts with cleared (``begin``), ``interrupt``
    (the Interrupt button), and the progress counters the sampler sets."""
    interrupted = False
    skipped = False
    stopping_generation = False
    job = ""
    job_count = 0
    job_timestamp = "0"  # A1111 sets a new timestamp string (to the second) when each job begins
    job_no = 0
    time_start = None    # and time.time() then
    sampling_step = 0
    sampling_steps = 0

    def begin(self, job="(unknown)"):
        self.sampling_step = 0
        self.job_count = -1
        self.time_start = time.time()
        self.job_no = 0
        self.job_timestamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
        self.skipped = False
        self.interrupted = False
        self.stopping_generation = False
        self.job = job

    def end(self):
        self.job = ""
        self.job_count = 0

    def interrupt(self):
        self.interrupted = True


state = State()
