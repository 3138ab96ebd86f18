"""Double of ``DefaultSessionRunner`` from ``invokeai/app/services/session_processor/session_processor_default.py``
(InvokeAI 6.14.2).

As the release: ``start(services, cancel_event, profiler=None)``; ``run(queue_item)`` calls the before-session
callbacks, then loops ``queue_item.session.next()`` (a ``NodeInputError`` there is a node error that ends the
loop) and ``run_node`` until the session is complete, has an error or is canceled, then the after-session
callbacks, after storing the session and completing the item unless it failed or was canceled.
``run_node`` builds ``InvocationContextData`` (the node, its source id from
``prepared_source_mapping``, the queue item) and the context, calls ``invocation.invoke_internal(context=,
services=)`` and ``session.complete(id, output)``, with the before/after-node callbacks and events around it.
A ``CanceledException`` records nothing; any other exception sets the node's error
("ErrorType: message"), fails the queue item, emits the error event and runs the node-error callbacks.
The release's processor runs one such runner per generation device, each in a thread named
``session_processor_N``; ``invoke_host.InvokeHost.run_concurrently`` does that for a list of graphs.
Not kept: workflow calls, idle-GPU offload, owner checks of multi-user mode, the profiler.
"""
import threading
import traceback
from typing import Any, Callable, Optional

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput
from invokeai.app.services.session_processor.session_processor_common import CanceledException
from invokeai.app.services.session_queue.session_queue_common import SessionQueueItem
from invokeai.app.services.shared.graph import NodeInputError
from invokeai.app.services.shared.invocation_context import InvocationContextData, build_invocation_context


class DefaultSessionRunner:
    def __init__(
        self,
        on_before_run_session_callbacks: Optional[list[Callable[..., Any]]] = None,
        on_before_run_node_callbacks: Optional[list[Callable[..., Any]]] = None,
        on_after_run_node_callbacks: Optional[list[Callable[..., Any]]] = None,
        on_node_error_callbacks: Optional[list[Callable[..., Any]]] = None,
        on_after_run_session_callbacks: Optional[list[Callable[..., Any]]] = None,
    ):
        self._on_before_run_session_callbacks = on_before_run_session_callbacks or []
        self._on_before_run_node_callbacks = on_before_run_node_callbacks or []
        self._on_after_run_node_callbacks = on_after_run_node_callbacks or []
        self._on_node_error_callbacks = on_node_error_callbacks or []
        self._on_after_run_session_callbacks = on_after_run_session_callbacks or []

    def start(self, services: Any, cancel_event: threading.Event, profiler: Any = None) -> None:
        self._services = services
        self._cancel_event = cancel_event
        self._profiler = profiler

    def _is_canceled(self) -> bool:
        return self._cancel_event.is_set()

    def run(self, queue_item: SessionQueueItem) -> None:
        for callback in self._on_before_run_session_callbacks:
            callback(queue_item=queue_item)
        while True:
            try:
                invocation = queue_item.session.next()
            except NodeInputError as e:
                self._on_node_error(e.node, queue_item, type(e).__name__, str(e), traceback.format_exc())
                break
            if invocation is None or self._is_canceled():
                break
            self.run_node(invocation, queue_item)
            if queue_item.session.is_complete() or self._is_canceled() \
                    or queue_item.status in ("failed", "canceled", "completed"):
                break
        queue_item = self._services.session_queue.set_queue_item_session(queue_item.item_id, queue_item.session)
        if queue_item.status not in ("canceled", "failed") and queue_item.session.is_complete():
            queue_item = self._services.session_queue.complete_queue_item(queue_item.item_id, queue_item=queue_item)
        for callback in self._on_after_run_session_callbacks:
            callback(queue_item=queue_item)

    def run_node(self, invocation: BaseInvocation, queue_item: SessionQueueItem) -> None:
        try:
            self._services.events.emit_invocation_started(queue_item=queue_item, invocation=invocation)
            for callback in self._on_before_run_node_callbacks:
                callback(invocation=invocation, queue_item=queue_item)
            data = InvocationContextData(
                invocation=invocation,
                source_invocation_id=queue_item.session.prepared_source_mapping[invocation.id],
                queue_item=queue_item,
            )
            context = build_invocation_context(data=data, services=self._services, is_canceled=self._is_canceled)
            output = invocation.invoke_internal(context=context, services=self._services)
            queue_item.session.complete(invocation.id, output)
            self._on_after_run_node(invocation, queue_item, output)
        except CanceledException:
            pass
        except Exception as e:
            self._on_node_error(invocation, queue_item, type(e).__name__, str(e), traceback.format_exc())

    def _on_after_run_node(self, invocation: BaseInvocation, queue_item: SessionQueueItem,
                           output: BaseInvocationOutput) -> None:
        self._services.events.emit_invocation_complete(invocation=invocation, queue_item=queue_item, output=output)
        for callback in self._on_after_run_node_callbacks:
            callback(invocation=invocation, queue_item=queue_item, output=output)

    def _on_node_error(self, invocation: BaseInvocation, queue_item: SessionQueueItem, error_type: str,
                       error_message: str, error_traceback: str) -> None:
        queue_item.session.set_node_error(invocation.id, f"{error_type}: {error_message}")
        self._services.logger.error(
            f"Error while invoking session {queue_item.session_id}, invocation {invocation.id} "
            f"({invocation.get_type()}): {error_message}")
        queue_item = self._services.session_queue.set_queue_item_session(queue_item.item_id, queue_item.session)
        queue_item = self._services.session_queue.fail_queue_item(queue_item.item_id, error_type, error_message,
                                                                   error_traceback)
        self._services.events.emit_invocation_error(queue_item=queue_item, invocation=invocation,
                                                    error_type=error_type, error_message=error_message,
                                                    error_traceback=error_traceback)
        for callback in self._on_node_error_callbacks:
            callback(invocation=invocation, queue_item=queue_item, error_type=error_type,
                     error_message=error_message, error_traceback=error_traceback)
