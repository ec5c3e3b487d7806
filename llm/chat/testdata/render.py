"""Renders the chat templates in this folder with jinja2 the way
transformers' apply_chat_template does, writing golden.json: the reference
the Go tests compare against.  Run from this folder: python3 render.py"""
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENS = {  # template: (bos_token, eos_token) of the model it comes from
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama31": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
    "qwen2": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),  # Qwen/Qwen3-* (the revision with `reasoning_content is string`)
    "gemma3": ("<bos>", "<eos>"),  # google/gemma-3-*-it
}
CASES = json.loads(Path("cases.json").read_text())


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
env.globals["raise_exception"] = raise_exception
out = {}
for name, (bos, eos) in TOKENS.items():
    src = Path(name + ".jinja").read_text().removesuffix("\n")
    tmpl = env.from_string(src)
    for case in CASES:
        key = name + "/" + case["name"]
        try:
            # a case's "vars" are apply_chat_template's extra keyword arguments
            out[key] = tmpl.render(messages=case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                   bos_token=bos, eos_token=eos, **case.get("vars", {}))
        except jinja2.exceptions.TemplateError as e:
            out[key] = "ERROR: " + str(e)
Path("golden.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
