"""Chat messages → prompt text, with the model's own chat template as transformers renders it.

The template comes from a file given with --chat-template, a GGUF's `tokenizer.chat_template`, or
`tokenizer_config.json` (`chat_template`: a string, or a list of named templates where "default"
wins). It is rendered by Jinja2 in
a sandbox (a template is data from the internet) with `messages`, `add_generation_prompt`, the BOS
and EOS strings and `raise_exception`. A base model without a template (the embedded default model)
gets its messages' contents joined by newlines, as mlx_lm.server does.
"""

from __future__ import annotations

import json
import os

from .. import jsonfile
from ..errors import UsageError


class ChatTemplate:
    def __init__(self, source: str | None, bos: str = "", eos: str = "", origin: str = "none"):
        self.source, self.bos, self.eos, self.origin = source, bos, eos, origin
        self._template = None
        if source is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise UsageError(f"{origin}: the chat template needs jinja2: pip install -e \".[serve]\" (or pip install "
                                 "jinja2)") from None
            from jinja2 import TemplateError

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            try:
                self._template = env.from_string(source)
            except TemplateError as exc:
                raise UsageError(f"{origin}: the chat template does not parse ({exc})") from None

    @property
    def name(self) -> str:
        return "model" if self.source is not None else "plain"

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            return "\n".join(m["content"] for m in messages) + "\n"

        def raise_exception(message):
            raise ValueError(message)

        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos,
                                     eos_token=self.eos, raise_exception=raise_exception)


def load_chat_template(model_path: str, override: str | None = None) -> ChatTemplate:
    """The template of ``override`` (a Jinja file), else the GGUF's own (`tokenizer.chat_template`,
    as llama.cpp reads it), else the model folder's tokenizer_config.json, else the plain join."""
    if override:
        with open(override, encoding="utf-8") as f:
            return ChatTemplate(f.read(), origin=override)
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        found = gguf_chat_template(model_path)
        if found is not None:
            return found
    folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return ChatTemplate(None)
    template, cfg = config_chat_template(path)

    def token(key):
        t = cfg.get(key)
        return t.get("content", "") if isinstance(t, dict) else (t or "")

    return ChatTemplate(template, token("bos_token"), token("eos_token"), origin=path)


def config_chat_template(path: str) -> tuple[str | None, dict]:
    """tokenizer_config.json's template (a string, or the "default" of named ones) and the config."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = jsonfile.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not readable JSON ({exc}); fix it or pass --chat-template FILE") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": …, "template": …}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise UsageError(f"{path}: chat_template must be a string or a list of named templates")
    return template, cfg


def gguf_chat_template(path: str) -> ChatTemplate | None:
    """The template a GGUF carries, with its BOS and EOS strings; None where it has none."""
    from ..model.formats.gguf_index import GGUFIndex

    index = GGUFIndex(path)
    template = index.metadata.get("tokenizer.chat_template")
    if not isinstance(template, str):
        return None
    tokens = index.array("tokenizer.ggml.tokens") or []

    def token(key):
        i = index.metadata.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

    return ChatTemplate(template, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"),
                        origin=f"{path} (tokenizer.chat_template)")
