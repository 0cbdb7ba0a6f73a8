"""``serve.py``: load the run once, then serve it with uvicorn until Ctrl-C or SIGTERM.

A signal stops the server taking connections, lets the requests in flight finish (their batches are scored and
answered), and the process exits 0: uvicorn's own handler would re-raise the signal once it has shut down, which
ends the process by the signal (exit 130 or 143) although nothing went wrong.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.serving.app import make_app
from rewarduq_exp.serving.settings import ServeSettings

log = logging.getLogger("rewarduq_exp")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose signals end it gracefully and nothing more; it says where it listens once it does
    (``serve.port=0`` takes any free port)."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                log.info("listening on http://%s:%d: POST /get_reward (OpenRLHF), POST /score, GET /health, "
                         "GET /info", host, port)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True   # a second Ctrl-C: stop waiting for the requests in flight
            return
        log.info("%s: no new connections; finishing the requests in flight, then exiting",
                 signal.Signals(sig).name)
        self.should_exit = True


def special_tokens(model) -> tuple[str, ...]:
    """The end-of-text and padding tokens of the run's tokenizer (what a policy leaves at the end of a response)."""
    tokenizer = getattr(model, "tokenizer", None)
    found = [getattr(tokenizer, name, None) for name in ("eos_token", "pad_token")]
    return tuple(dict.fromkeys(t for t in found if isinstance(t, str) and t))


def serve(cfg) -> None:
    from rewarduq_exp.api import load_run

    settings = ServeSettings.of(cfg.get("serve"))
    check_can_listen(settings.host, int(settings.port))   # before the model loads
    if cfg.get("run") is None:
        raise UserError("run is missing: python serve.py run=<a completed run folder>")
    if not isinstance(cfg.get("truncation", True), bool):
        raise UserError(f"truncation={cfg.get('truncation')!r} is invalid: must be true or false")
    model = load_run(str(cfg.run), device=str(cfg.device), batch_size=cfg.get("batch_size"),
                     recalibrated=bool(cfg.get("recalibrated", True)), truncation=bool(cfg.get("truncation", True)),
                     cache_dir=cfg.paths.get("cache_dir"), progress=False,
                     trust_remote_code=bool(cfg.get("trust_remote_code", False)))
    model.score(["warm-up"], ["the first call loads the backbone"])   # before the first client waits for it
    app = make_app(model, settings, strip=special_tokens(model))
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.token is None:
        log.warning("serve.host=%s listens beyond this machine without a token: anyone who reaches the port can "
                    "score (set serve.token or REWARDUQ_SERVE_TOKEN)", settings.host)
    config = uvicorn.Config(app, host=settings.host, port=int(settings.port), log_level="warning",
                            timeout_graceful_shutdown=int(max(1, settings.request_timeout_s)), access_log=False)
    server = DrainingServer(config)
    log.info("serving %s (%s on %s, %s)", model.run_dir, model.name, model.config.model.name,
             "recalibrated" if model.recalibrated else "raw")
    try:
        server.run()
    except SystemExit:
        if not server.started:   # uvicorn could not bind after all (taken since the check): it logged why
            raise UserError(cannot_listen(settings.host, settings.port, "taken")) from None
        raise


def cannot_listen(host: str, port: int, why: str) -> str:
    return (f"cannot listen on {host}:{port} ({why}); pass serve.port=<another port> (0: any free one) or "
            "serve.host=<an address of this machine>")


def check_can_listen(host: str, port: int) -> None:
    """One line when ``host:port`` cannot be listened on (taken, or not an address of this machine)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise UserError(cannot_listen(host, port, f"not an address: {err.strerror or err}")) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise UserError(cannot_listen(host, port, err.strerror or str(err))) from None
