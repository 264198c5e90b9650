"""Chat templates: where a checkpoint keeps one (chat_template.jinja over tokenizer_config.json's
string or named "default" template; a GGUF's metadata), and the sandbox they run in, set up as
transformers sets it up (its tojson, raise_exception, namespace and dict; Python internals out of
reach). The ids on a real template against transformers are tests/serve/test_chat.py's."""

from __future__ import annotations

import json
import shutil

import pytest

from aioprefill import Tokenizer
from aioprefill.errors import InvalidRequest
from aioprefill.text.chat_template import ChatTemplateError, render_chat
from tests.tokenizer_files import SMOLLM2_DIR, smollm2_gguf

HI = [{"role": "user", "content": "hi"}]


def checkpoint(tmp_path, config_template=None, jinja=None):
    d = tmp_path / "ckpt"
    shutil.copytree(SMOLLM2_DIR, d)
    if config_template is not None:
        config = json.loads((d / "tokenizer_config.json").read_text())
        config["chat_template"] = config_template
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return Tokenizer.from_pretrained(d)


def test_where_a_checkpoint_keeps_its_template(tmp_path):
    assert checkpoint(tmp_path).chat_template is None
    shutil.rmtree(tmp_path / "ckpt")
    assert checkpoint(tmp_path, "A{{ 1 }}").chat_template == "A{{ 1 }}"
    shutil.rmtree(tmp_path / "ckpt")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert checkpoint(tmp_path, named).chat_template == "D"
    shutil.rmtree(tmp_path / "ckpt")
    tok = checkpoint(tmp_path, "from config", jinja="from file")
    assert tok.chat_template == "from file"  # transformers' order
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    gguf = Tokenizer.from_pretrained(smollm2_gguf())
    assert "<|im_start|>" in gguf.chat_template
    texts = {
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "unk": "<|endoftext|>",
        "pad": "<|im_end|>",
    }
    assert gguf.special_tokens == {f"{k}_token": v for k, v in texts.items()}


def test_the_sandbox_is_transformers():
    # tojson without HTML escaping, unicode kept; special tokens and kwargs as variables
    out = render_chat("{{ messages | tojson }}{{ eos_token }}{{ x }}",
                      [{"role": "user", "content": "<b>é</b>", "name": None}],
                      special_tokens={"eos_token": "</s>"}, template_kwargs={"x": 1})  # fmt: skip
    assert out == '[{"role": "user", "content": "<b>é</b>"}]</s>1'  # None-valued keys dropped
    # trim_blocks / lstrip_blocks, loop controls, namespace, dict, the generation block
    template = ("{% set ns = namespace(n=0) %}\n  {% for m in messages %}{% if loop.index > 1 %}"
                "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% endfor %}\n{{ ns.n }}{{ dict(a=1).a }}")  # fmt: skip
    assert render_chat(template, [*HI, *HI]) == "hi11"
    with pytest.raises(ChatTemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", HI)
    for escape in ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
                   "{{ cycler.__init__.__globals__ }}",
                   "{% set ns = namespace() %}{% set ns._x = 1 %}",
                   "{{ messages.append(1) }}"):  # fmt: skip
        with pytest.raises(ChatTemplateError):
            render_chat(escape, HI)
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        render_chat("{% for %}", HI)
    assert isinstance(ChatTemplateError("x"), InvalidRequest)  # a 400


def test_continue_final_message():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    msgs = [*HI, {"role": "assistant", "content": "Hello, wor"}]
    assert (
        render_chat(template, msgs, continue_final_message=True)
        == "<user>hi</s><assistant>Hello, wor"
    )
    with pytest.raises(InvalidRequest, match="cannot both"):
        render_chat(template, msgs, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(InvalidRequest, match="drops part"):
        render_chat("{{ messages[0].content }}", msgs, continue_final_message=True)
    with pytest.raises(InvalidRequest, match="must not be empty"):
        render_chat(template, [])
