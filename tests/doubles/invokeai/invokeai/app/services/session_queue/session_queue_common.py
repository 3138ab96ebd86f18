"""Double of ``SessionQueueItem`` from ``invokeai/app/services/session_queue/session_queue_common.py``
(InvokeAI 6.14.2): the queue item a session runs as, with the release's fields a node or runner reads, and
``SessionQueueItemNotFoundError``."""
import datetime
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from invokeai.app.services.shared.graph import GraphExecutionState

class SessionQueueItemNotFoundError(ValueError):
    """What the queue raises for an item id it does not hold (as the release's, a ValueError)."""


QUEUE_ITEM_STATUS = Literal["pending", "in_progress", "completed", "failed", "canceled"]


class SessionQueueItem(BaseModel):
    item_id: int = Field(description="Queue item id")
    status: QUEUE_ITEM_STATUS = Field(default="pending", description="Status")
    priority: int = Field(default=0, description="Priority")
    batch_id: str = Field(description="Batch id")
    origin: Optional[str] = Field(default=None, description="Origin")
    destination: Optional[str] = Field(default=None, description="Destination")
    session_id: str = Field(description="Id of the session")
    error_type: Optional[str] = Field(default=None, description="Error type")
    error_message: Optional[str] = Field(default=None, description="Error message")
    error_traceback: Optional[str] = Field(default=None, description="Error traceback")
    created_at: Union[datetime.datetime, str] = Field(description="Created")
    updated_at: Union[datetime.datetime, str] = Field(description="Updated")
    started_at: Optional[Union[datetime.datetime, str]] = Field(description="Started")
    completed_at: Optional[Union[datetime.datetime, str]] = Field(description="Completed")
    queue_id: str = Field(description="Queue id")
    user_id: str = Field(default="system", description="Owner")
    device: Optional[str] = Field(default=None, description="Device that ran it (set on a GPU only)")
    session: GraphExecutionState = Field(description="The session to run")
    workflow: Optional[Any] = Field(default=None, description="The workflow, if the item came from one")
