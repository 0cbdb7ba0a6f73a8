"""A client of ``serve.py`` for an RL loop in another process: ``RemoteReward(url)`` is a reward function TRL's
GRPOTrainer / RLOOTrainer accept (``reward_funcs=RemoteReward("http://127.0.0.1:5000")``), scoring each step's
completions through the server's ``POST /score``. Standard library only: it runs wherever the trainer runs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class RemoteReward:
    """``reward_func(prompts, completions, **kwargs) -> list[float]``: the server's ``rewards`` (r, or r - k u with
    ``k``). A refusal of the server is raised with its one line."""

    def __init__(self, url: str, k: float | None = None, token: str | None = None, timeout: float = 300):
        self.url, self.k, self.token, self.timeout = url.rstrip("/"), k, token, timeout
        self.__name__ = "rewarduq_remote_reward" if k is None else f"rewarduq_remote_reward_k{k:g}"

    def score(self, prompts, completions) -> dict:
        """The server's whole answer: rewards, reward, lower, upper, uncertainty."""
        body = {"prompts": list(prompts), "completions": list(completions)}
        if self.k is not None:
            body["k"] = self.k
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(f"{self.url}/score", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as err:
            try:
                said = json.loads(err.read()).get("error", "")
            except ValueError:
                said = ""
            raise RuntimeError(f"the reward server refused the request ({err.code}): {said}") from None

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        return [float(r) for r in self.score(prompts, completions)["rewards"]]
