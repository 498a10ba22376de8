"""Remote actors: the websocket wire, auth, failure detection.

Plug a :class:`WebSocketTransport` into an :class:`~dniasync.actors.ActorSystem`
and refs to actors on other nodes (``name@host:port``) work like local ones.
``actors`` never imports this package; it reads only the message registry.
"""

from ._auth import Authenticator, read_token_file
from ._codec import Decoder, Frame, Limits, encode
from ._errors import AuthError, DecodeError, ProtocolError, RemoteError
from ._guard import ConnectionGuard, serve_guarded
from ._latency import ASK_LATENCY_BUCKETS, AskLatency
from ._settings import RemoteCounters, RemoteSettings
from ._transport import PeerListener, WebSocketTransport, is_loopback, parse_hostport

__all__ = [
    "ASK_LATENCY_BUCKETS",
    "AskLatency",
    "AuthError",
    "ConnectionGuard",
    "Authenticator",
    "DecodeError",
    "Decoder",
    "Frame",
    "Limits",
    "PeerListener",
    "ProtocolError",
    "RemoteCounters",
    "RemoteError",
    "RemoteSettings",
    "WebSocketTransport",
    "encode",
    "is_loopback",
    "parse_hostport",
    "read_token_file",
    "serve_guarded",
]
