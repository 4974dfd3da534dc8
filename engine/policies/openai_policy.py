"""The OpenAI-compatible policy: LM Studio, Ollama, llama.cpp server, vLLM or a hosted API.

It passes the recorded per-step `seed`, so a local model with a fixed seed replays exactly; the
server's fingerprint and the model name are journaled as the provenance of each action."""

from __future__ import annotations

import json
import os
from typing import Any

from engine.errors import PolicyError
from engine.policies.base import AgentView, Completion

DEFAULT_BASE_URL = "http://localhost:1234/v1"


class OpenAIPolicy:
    """Chat completions through the `openai` client, with timeouts and bounded retries."""

    name = "openai"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        model: str = "local-model",
        *,
        temperature: float = 0.8,
        max_tokens: int = 160,
        timeout: float = 60.0,
        max_retries: int = 2,
    ) -> None:
        import openai

        self.base_url = base_url
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.max_retries = max_retries
        self._openai = openai
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=os.environ.get("OPENAI_API_KEY") or "not-needed",
            timeout=timeout,
            max_retries=max_retries,
        )

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "base_url": self.base_url,
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
        }

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        oa = self._openai
        try:
            resp = self._client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                seed=seed,
                temperature=self.temperature,
                max_tokens=self.max_tokens,
            )
        except oa.APITimeoutError as e:
            raise PolicyError(
                f"LLM server {self.base_url!r} timed out after {self.timeout:g}s "
                f"({self.max_retries} retries)"
            ) from e
        except oa.APIConnectionError as e:
            raise PolicyError(
                f"LLM server {self.base_url!r} is unreachable: {e.__cause__ or e}"
            ) from e
        except oa.APIStatusError as e:
            raise PolicyError(
                f"LLM server {self.base_url!r} answered HTTP {e.status_code}: "
                f"{_clip(str(e.message))}"
            ) from e
        except oa.OpenAIError as e:
            raise PolicyError(f"LLM server {self.base_url!r} failed: {_clip(str(e))}") from e
        except json.JSONDecodeError as e:  # a JSON content type whose body does not parse
            raise PolicyError(
                f"LLM server {self.base_url!r} answered with malformed JSON: {_clip(str(e))}"
            ) from e
        try:
            return self._completion(resp)
        except (AttributeError, TypeError, ValueError, IndexError) as e:
            raise PolicyError(
                f"LLM server {self.base_url!r} returned a malformed completion: {_clip(str(e))}"
            ) from e

    def _completion(self, resp: Any) -> Completion:
        choices = getattr(resp, "choices", None)
        if not choices or choices[0].message is None:
            raise PolicyError(f"LLM server {self.base_url!r} returned no choices")
        text = choices[0].message.content
        if not isinstance(text, str):
            raise PolicyError(f"LLM server {self.base_url!r} returned no message text")
        usage = getattr(resp, "usage", None)
        return Completion(
            text=text,
            model=str(getattr(resp, "model", None) or self.model),
            finish_reason=str(choices[0].finish_reason or "unknown"),
            prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
            completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
            system_fingerprint=getattr(resp, "system_fingerprint", None),
        )


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
