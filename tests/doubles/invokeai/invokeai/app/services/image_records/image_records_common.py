"""Double of ``ImageCategory`` from ``invokeai/app/services/image_records/image_records_common.py``
(InvokeAI 6.14.2); only GENERAL images show in the gallery."""
from enum import Enum


class ImageCategory(str, Enum):
    GENERAL = "general"
    MASK = "mask"
    CONTROL = "control"
    USER = "user"
    OTHER = "other"
