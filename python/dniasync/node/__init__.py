"""The node process: ``python -m dniasync.node --role coordinator|ps|worker ...``.

Roles are pluggable (:data:`ROLES`, :func:`register_role`); every node runs
a ``node`` actor answering :class:`NodeStatus`, and members keep a view of
the cluster that the coordinator updates on joins and departures.
"""

from ._membership import (
    COORDINATOR,
    MEMBERSHIP,
    Coordinator,
    GetMembers,
    Join,
    Leave,
    Member,
    MemberDown,
    MemberUp,
    Members,
    Membership,
)
from ._roles import (
    NEEDS_JOIN,
    NODE_INFO,
    ROLES,
    NodeContext,
    NodeInfo,
    NodeStatus,
    NodeStatusReply,
    RoleStarter,
    register_role,
)
from ._metrics import metric_catalogue, mount_metrics
from .cli import main

__all__ = [
    "COORDINATOR",
    "MEMBERSHIP",
    "NEEDS_JOIN",
    "NODE_INFO",
    "ROLES",
    "Coordinator",
    "GetMembers",
    "Join",
    "Leave",
    "Member",
    "MemberDown",
    "MemberUp",
    "Members",
    "Membership",
    "NodeContext",
    "NodeInfo",
    "NodeStatus",
    "NodeStatusReply",
    "RoleStarter",
    "main",
    "metric_catalogue",
    "mount_metrics",
    "register_role",
]
