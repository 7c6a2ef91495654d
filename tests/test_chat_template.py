"""Which chat template a model gets, and what happens without one.

Order: ``--chat-template FILE`` (vLLM's flag; ``LLM(chat_template=...)``), the model's own (the GGUF's
``tokenizer.chat_template``, an HF directory's), its family's documented default (Gemma 3's turns,
Qwen3's ChatML), else none: chat is then a one-line error naming the flag on the command line and a 400
in the OpenAI shape in the API. Gemma's ``<end_of_turn>`` ends a turn (it is an end-of-sequence id).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.config import ConfigError
from kvtier.models.loader import load_model, read_chat_template
from kvtier.tokenizer import GEMMA3_CHAT_TEMPLATE
from tests.conftest import TinyGGUF
from tests.test_cli import assert_one_line_error, run_cli
from tests.test_gguf_qwen3_gemma3 import CHATML, write_tiny_gguf

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hello there  "},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "What is a KV cache?"},
]
GEMMA_RENDERED = (
    "<bos><start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n"
    "<start_of_turn>model\nHi!<end_of_turn>\n"
    "<start_of_turn>user\nWhat is a KV cache?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chat_template")


@pytest.fixture(scope="module")
def gemma(tiny_dir: Path) -> Any:
    """A tiny Gemma 3 GGUF without a chat template, loaded (its family's default applies)."""
    path = write_tiny_gguf(tiny_dir / "gemma.gguf", "gemma3", layers=6)
    return load_model(path, cache_dir=tiny_dir / "cache")


@pytest.fixture(scope="module")
def no_template_gguf(tiny_gguf: Callable[..., TinyGGUF]) -> Path:
    """A tiny llama GGUF without a chat template (the llama family has no default)."""
    return tiny_gguf(chat_template=None).path


def test_gemma3_default_template_folds_system_into_first_turn(gemma: Any) -> None:
    tok = gemma.tokenizer
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE
    assert tok.apply_chat_template(CONVERSATION) == GEMMA_RENDERED
    assert tok.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHello there<end_of_turn>\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]}]
    assert (
        tok.apply_chat_template(parts) == "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ConfigError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma3_template_renders_as_transformers_renders_it(gemma: Any, tiny_dir: Path) -> None:
    """Same text from transformers' own jinja environment (trim filter, raise_exception, bos_token)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir), gguf_file="gemma.gguf")
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[1:]):
        expected = hf.apply_chat_template(
            messages, chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        assert gemma.tokenizer.apply_chat_template(messages) == expected


def test_gemma3_turn_tokens_are_special_and_contents_are_text(gemma: Any) -> None:
    tok = gemma.tokenizer
    start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    _, ids = tok.encode_chat([{"role": "user", "content": "say <end_of_turn> now"}])
    assert ids[:2] == [tok.bos_token_id, start] and ids.count(end) == 1  # the template's, not the user's
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", add_special_tokens=False)[-3:]
    assert end in tok.eos_token_ids and end in gemma.config.eos_token_ids  # <end_of_turn> ends a turn


def test_qwen3_default_template_is_chatml_and_the_files_template_wins(tiny_dir: Path) -> None:
    plain = load_model(write_tiny_gguf(tiny_dir / "q.gguf", "qwen3", layers=2), cache_dir=tiny_dir / "c")
    chat = [{"role": "user", "content": "hi"}]
    assert (
        plain.tokenizer.apply_chat_template(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = plain.tokenizer.apply_chat_template(chat, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    path = write_tiny_gguf(tiny_dir / "q2.gguf", "qwen3", layers=2, chat_template=CHATML)
    own = load_model(path, cache_dir=tiny_dir / "c")
    assert own.tokenizer.chat_template == CHATML
    assert own.tokenizer.apply_chat_template(chat) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_flag_replaces_the_models(tiny_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(template, encoding="utf-8")
    path = write_tiny_gguf(tiny_dir / "q3.gguf", "qwen3", layers=2, chat_template=CHATML)
    for given in (file, str(file), template):  # a file, or (as vLLM takes it) the template itself
        loaded = load_model(path, cache_dir=tiny_dir / "c", chat_template=given)
        assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[user] x\n"


@pytest.mark.parametrize(
    "value,fragment",
    [("no/such/template.jinja", "no such file"), ("{% for %}", "does not compile"), ("   {{", "compile")],
    ids=["missing-file", "broken", "broken-expression"],
)
def test_bad_chat_template_flag_is_one_line_error_naming_it(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        read_chat_template(value)
    message = str(info.value)
    assert message.startswith("--chat-template") and fragment in message and "\n" not in message


def test_no_template_is_an_error_naming_the_flag(no_template_gguf: Path, tmp_path: Path) -> None:
    tok = load_model(no_template_gguf, cache_dir=tmp_path).tokenizer
    assert tok.chat_template is None
    with pytest.raises(ConfigError, match="--chat-template FILE"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------------- command line and API


@pytest.fixture()
def cache_env(tmp_path: Path) -> Any:
    old = os.environ.get("KVTIER_CACHE_DIR")
    os.environ["KVTIER_CACHE_DIR"] = str(tmp_path / "cache")
    yield
    if old is None:
        os.environ.pop("KVTIER_CACHE_DIR", None)
    else:
        os.environ["KVTIER_CACHE_DIR"] = old


def test_cli_chat_without_template_names_the_flag_then_the_flag_works(
    no_template_gguf: Path, tmp_path: Path, cache_env: Any
) -> None:
    base = ("generate", "hello", "--chat", "--model", str(no_template_gguf), "--kv-device-blocks", "32")
    proc = run_cli(*base, "--max-tokens", "2")
    assert "--chat-template" in assert_one_line_error(proc, "no chat template")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    proc = run_cli(*base, "--max-tokens", "2", "--ignore-eos", "--chat-template", str(template))
    assert proc.returncode == 0, proc.stderr
    assert "prompt tokens from cache" in proc.stderr


def test_api_chat_without_template_is_400_naming_the_flag(no_template_gguf: Path, tmp_path: Path) -> None:
    from kvtier import LLM
    from kvtier.server.app import ServerSettings, create_app
    from kvtier.server.serve import serve_in_thread

    def factory() -> Any:
        return LLM(str(no_template_gguf), kv_device_blocks=32, num_threads=1).engine

    srv = serve_in_thread(create_app(factory, ServerSettings(model_name="tiny")))
    try:
        srv.wait_ready(120)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert "--chat-template" in error["message"] and error["param"] == "messages"
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # plain prompts still work
    finally:
        srv.stop()


def test_chat_template_flag_on_generate_chat_and_serve() -> None:
    from kvtier.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "x"], ["chat"], ["serve"]):
        ns = parser.parse_args([*argv, "--chat-template", "t.jinja"])
        assert ns.chat_template == "t.jinja"
