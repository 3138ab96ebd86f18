"""Double of Forge Neo's modules/sd_samplers_cfg_denoiser.py (7862a964): Forge's, asking
``apply_refiner(self, x, sigma[0])``."""
from tests.doubles.underneath import extend

extend(globals(), "sd_samplers_cfg_denoiser", root="forge_jobs")

_ForgeCFGDenoiser = CFGDenoiser


class CFGDenoiser(_ForgeCFGDenoiser):
    def refine(self, x, sigma):
        return sd_samplers_common.apply_refiner(self, x, sigma[0])
