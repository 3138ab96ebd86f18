"""Double of reForge's modules/sd_hijack.py: a stub hijack with no optimizer list."""


class StableDiffusionModelHijack:
    fixes = None
    layers = None
    circular_enabled = False
    clip = None
    optimization_method = None

    def apply_optimizations(self, option=None):
        pass

    def convert_sdxl_to_ssd(self, m):
        pass

    def hijack(self, m):
        pass

    def undo_hijack(self, m):
        pass

    def apply_circular(self, enable):
        pass

    def clear_comments(self):
        pass

    def redo_hijack(self, m):
        pass


model_hijack = StableDiffusionModelHijack()
