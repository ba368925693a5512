"""Chat prompts: a checkpoint's Jinja chat template, rendered as Hugging Face renders it.

A model directory keeps its template in ``chat_template.jinja`` (transformers 5) or under
``"chat_template"`` in ``tokenizer_config.json`` (transformers 4: a string, or a list of
named templates of which ``"default"`` is used). The special tokens named in
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) are template variables, as
in transformers.

The rendered text already holds every special token the model expects, so it is encoded
without the tokenizer's own additions (``add_special_tokens=False``): a template that
writes the BOS token would otherwise get a second one.

Templates run in Jinja's immutable sandbox: a template is code that came with the model.
Messages are text (``content`` a string); tools, documents and the ``{% generation %}``
tag of training templates are not supported.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cascadeinfer.engine.model_loader import ModelLoadError

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A chat template and the special tokens it may refer to.

    Attributes:
        source: the Jinja text.
        special_tokens: ``{"bos_token": "<s>", ...}``, passed to the template as variables.
        origin: the file the template came from (named in errors).
    """

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = "chat template"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ModelLoadError(f"{self.origin}: the chat template must be a non-empty string")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation.

        ``messages``: ``[{"role": "user", "content": "Hi"}, ...]``; roles and contents are
        strings. ``add_generation_prompt`` appends the opening of the assistant's turn.
        """
        _check_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt: expected a bool, got {add_generation_prompt!r}")
        template = _compile(self.source, self.origin)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
        except Exception as exc:  # a template may raise anything, raise_exception() included
            raise ValueError(f"messages: the chat template of {self.origin} rejected them ({exc})") from None


def _check_messages(messages: object) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}]: expected a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TypeError(f"messages[{i}]: {key!r} must be a string, got {message.get(key)!r}")


@functools.lru_cache(maxsize=8)  # rendering is per request; compiling once is enough
def _compile(source: str, origin: str):
    try:
        import jinja2  # noqa: PLC0415
        import jinja2.ext  # noqa: PLC0415  (loopcontrols: {% break %}, {% continue %})
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    except ImportError:
        raise ModelLoadError("chat templates need the jinja2 package: pip install jinja2") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # The same whitespace rules as transformers, so that both render the same text.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"{origin}: malformed chat template ({exc})") from None


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a model directory, or None when it has none."""
    path = Path(model_dir)
    config_path = path / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{config_path}: malformed JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ModelLoadError(f"{config_path}: expected a JSON object")
    jinja_path = path / "chat_template.jinja"
    if jinja_path.is_file():
        source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    else:
        source, origin = _template_from_config(config.get("chat_template"), str(config_path))
        if source is None:
            return None
    return ChatTemplate(source, _special_tokens(config), origin)


def _template_from_config(value: object, origin: str) -> tuple[str | None, str]:
    if value is None or isinstance(value, str):
        return value, origin
    if isinstance(value, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"], f"{origin} (template 'default')"
        return None, origin
    raise ModelLoadError(f"{origin}: 'chat_template' must be a string or a list of named templates")


def _special_tokens(config: dict) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
