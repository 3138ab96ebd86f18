"""Double of Forge Neo's modules/sd_models.py (7862a964): Forge's reload (``tests/doubles/forge_jobs``),
and before it builds the next model Neo deletes the dropped one's objects (``NEO_DROPS``): what still holds
that model object (``p.sd_model``, set at the job's start) finds no ``forge_objects`` on it."""
from tests.doubles.underneath import extend

extend(globals(), "sd_models", root="forge_jobs")

NEO_DROPS = ("model_config", "forge_objects", "forge_objects_original", "forge_objects_after_applying_lora",
             "text_processing_engine", "text_processing_engine_l", "text_processing_engine_g",
             "text_processing_engine_t5", "model")
