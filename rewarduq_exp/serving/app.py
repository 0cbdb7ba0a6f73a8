"""The ASGI application: routes, the bearer token, the body's limits and the one-line JSON errors.

Starlette rather than FastAPI: the routes take two request shapes whose every refusal must be one line naming the
limit or field (FastAPI's validation answers with a list of pydantic errors), and Starlette is what FastAPI is built
on, without the model layer this server does not use. uvicorn runs it (:mod:`.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.serving.batcher import QueueFull, ScoreBatcher
from rewarduq_exp.serving.requests import RequestError, Scoring, openrlhf_request, score_request
from rewarduq_exp.serving.settings import ServeSettings

log = logging.getLogger(__name__)


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)


async def read_json(request: Request, settings: ServeSettings) -> dict:
    """The body as a JSON object, within ``max_body_bytes`` and ``body_timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise RequestError(413, f"the body has {declared} bytes, more than serve.max_body_bytes="
                                f"{settings.max_body_bytes}")
    chunks, size = [], 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise RequestError(413, f"the body has more than serve.max_body_bytes={settings.max_body_bytes} "
                                        "bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), settings.body_timeout_s)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within serve.body_timeout_s={settings.body_timeout_s:g} s")\
            from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not JSON ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(body, dict):
        raise RequestError(422, f"the body must be a JSON object, not a {type(body).__name__}")
    return body


def make_app(model, settings: ServeSettings, strip: tuple[str, ...] = ()) -> Starlette:
    """The server of ``model`` (a :class:`rewarduq_exp.api.RewardModel`)."""

    def score_fn(parts):
        scores = model.score_prepared(parts)
        return scores.reward, scores.u

    batcher = ScoreBatcher(score_fn, settings.max_batch, settings.max_wait_ms / 1000, settings.max_queue,
                           prepare_fn=model.prepare)
    beta = model.beta

    def authorised(request: Request) -> bool:
        if settings.token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode())

    def unauthorised() -> JSONResponse:
        return error(401, "missing or wrong bearer token: send the header Authorization: Bearer <serve.token>",
                     {"WWW-Authenticate": "Bearer"})

    async def answer(request: Request, parse) -> JSONResponse:
        if not authorised(request):
            return unauthorised()
        try:
            scoring: Scoring = parse(await read_json(request, settings))
            reward, u = await asyncio.wait_for(batcher.score(scoring.prompts, scoring.completions),
                                               settings.request_timeout_s)
        except RequestError as err:
            return error(err.status, err.message)
        except QueueFull as err:
            return error(503, str(err), {"Retry-After": "1"})
        except TimeoutError:
            return error(504, f"not scored within serve.request_timeout_s={settings.request_timeout_s:g} s")
        except UserError as err:   # the model refused a text (too long for its max_length, say)
            return error(422, str(err))
        except Exception as err:   # noqa: BLE001 (never a traceback to the client: it is in the server's log)
            log.exception("scoring failed")
            return error(500, f"scoring failed ({type(err).__name__}); the server's log has the details")
        rewards = reward if scoring.k is None else reward - scoring.k * u
        return JSONResponse({"rewards": _floats(rewards), "reward": _floats(reward),
                             "lower": _floats(reward - beta * u), "upper": _floats(reward + beta * u),
                             "uncertainty": _floats(u), "k": scoring.k})

    async def get_reward(request: Request) -> JSONResponse:
        return await answer(request, lambda body: openrlhf_request(
            body, max_items=settings.max_items, max_chars=settings.max_chars, default_k=settings.k, strip=strip))

    async def score(request: Request) -> JSONResponse:
        return await answer(request, lambda body: score_request(
            body, max_items=settings.max_items, max_chars=settings.max_chars, default_k=settings.k))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        if not authorised(request):
            return unauthorised()
        calibration = model.calibration
        return JSONResponse({
            "run": str(model.run_dir), "method": model.name, "model": str(model.config.model.name), "beta": beta,
            "recalibrated": model.recalibrated,
            "calibration": None if calibration is None else {"temperature": calibration.temperature,
                                                             "interval": calibration.interval,
                                                             "scale": calibration.scale},
            "settings": settings.shown(), "batches": batcher.batches, "received": batcher.received,
            "scored": batcher.scored,
            "queued": batcher.queued, "busy_s": round(batcher.busy_s, 3)})

    async def not_found(request: Request, exc) -> JSONResponse:
        return error(404, f"no route {request.url.path}; routes: POST /get_reward, POST /score, GET /health, GET /info")

    async def not_allowed(request: Request, exc) -> JSONResponse:
        return error(405, f"{request.method} {request.url.path} is not allowed; routes: POST /get_reward, POST /score, "
                          "GET /health, GET /info")

    async def server_error(request: Request, exc) -> JSONResponse:
        log.error("request failed: %s", exc)
        return error(500, "the request failed; the server's log has the details")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    routes = [Route("/get_reward", get_reward, methods=["POST"]), Route("/score", score, methods=["POST"]),
              Route("/health", health, methods=["GET"]), Route("/info", info, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, 500: server_error},
                    lifespan=lifespan)
    app.state.batcher = batcher
    return app


def _floats(values) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=float)]
