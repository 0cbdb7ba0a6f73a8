"""``serve.*`` of conf/serve.yaml, checked once before anything loads: one line naming the setting and what is
allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import check_bound


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 5000
    k: float | None = None
    token: str | None = None
    max_batch: int = 256
    max_wait_ms: float = 5.0
    max_items: int = 1024
    max_chars: int = 65536
    max_body_bytes: int = 8 * 2**20
    max_queue: int = 16384
    body_timeout_s: float = 30.0
    request_timeout_s: float = 300.0

    @classmethod
    def of(cls, node) -> ServeSettings:
        values = dict(node or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise UserError(f"serve.{unknown[0]} is not a setting of serve.py; allowed: "
                            f"{', '.join(cls.__dataclass_fields__)}")
        out = cls(**values)
        out.check()
        return out

    def check(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise UserError(f"serve.host={self.host!r} is invalid: must be an address to listen on (127.0.0.1: this "
                            "machine only; 0.0.0.0: every interface)")
        for key in ("port", "max_batch", "max_items", "max_chars", "max_body_bytes", "max_queue"):
            check_bound(f"serve.{key}", getattr(self, key))   # the bounds' one table (core.setting_bounds)
        if self.max_queue < self.max_items:
            raise UserError(f"serve.max_queue={self.max_queue} is invalid: must be at least serve.max_items "
                            f"({self.max_items}), or no request of the largest size could ever be queued")
        for key in ("max_wait_ms", "body_timeout_s", "request_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"serve.{key}={value!r} is invalid: must be a number >= 0")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, (int, float))
                                   or not math.isfinite(self.k) or self.k < 0):
            raise UserError(f"serve.k={self.k!r} is invalid: must be null (the reward) or a number >= 0 (r - k u)")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise UserError("serve.token is invalid: must be null (no token) or a non-empty string")

    def shown(self) -> dict:
        """The settings as /info shows them: the token never, only whether there is one."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "token"}
        return {**out, "token": self.token is not None}
