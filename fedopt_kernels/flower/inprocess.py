"""A Flower ``Grid`` that delivers messages to ClientApp functions in this process, one after another.

For unit tests and debugging of strategies: no Ray, no SuperLink, no sockets, so a round takes
milliseconds and a breakpoint in a client stops the whole run. Each node has its own ``Context``
(``node_config`` with ``partition-id`` / ``num-partitions``, persistent ``state``), like a
simulated SuperNode. It is not Flower's simulation engine: runs meant to show that an app works
on Flower use ``flwr run`` (see ``docs/flower.md``).

``app(message, context)`` may return None to model a client that dropped out (no reply); an
exception it raises becomes an error reply, as in Flower's engines.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, List, Mapping, Optional
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

ClientFn = Callable[[Message, Context], Optional[Message]]

_CLIENT_APP_RAISED_EXCEPTION = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
_SUPERLINK_NODE_ID = 1


class InProcessGrid(Grid):
    """``num_nodes`` nodes with ids ``first_node_id + i`` and ``partition-id = i``, all served by ``app``."""

    def __init__(
        self, app: ClientFn, num_nodes: int, run_config: Optional[Mapping] = None, first_node_id: int = 2**63 - 2
    ):  # Flower ids are unsigned 64-bit: straddle int64
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
        self.app = app
        # Message() reads the sending task's identity, which Flower's runtimes set per process
        for name, value in (("run_id", 0), ("node_id", _SUPERLINK_NODE_ID), ("task_id", 0)):
            try:
                getattr(TaskIdentity, name)
            except RuntimeError:
                setattr(TaskIdentity, name, value)
        self.contexts: Dict[int, Context] = {
            first_node_id + i: Context(
                run_id=0,
                node_id=first_node_id + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i in range(num_nodes)
        }
        self._replies: Dict[str, Message] = {}
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: Optional[float] = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = uuid4().hex
            msg.metadata.__dict__["_src_node_id"] = _SUPERLINK_NODE_ID
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                raise ValueError(f"message for node {node}, which is not one of this grid's nodes")
            # the client works on its own copy, as it would after a transport
            received = Message(
                copy.deepcopy(msg.content), node, msg.metadata.message_type, group_id=msg.metadata.group_id
            )
            received.metadata.__dict__.update(
                {
                    k: v
                    for k, v in msg.metadata.__dict__.items()
                    if k in ("_message_id", "_src_node_id", "_run_id", "_created_at", "_ttl")
                }
            )
            try:
                reply = self.app(received, self.contexts[node])
            except Exception as exc:
                reply = Message(Error(_CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"), reply_to=received)
            if reply is not None:
                self._replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in list(message_ids) if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> List[Message]:
        return list(self.pull_messages(self.push_messages(messages)))
