"""Shared fixtures: tiny Hugging Face models (random weights, built here) and their tokenizer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

if not os.environ.get("TRITON_INTERPRET"):
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run on the CPU interpreter
    except ImportError:
        pass

def start_server(model_dir: Path | None, *flags: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """Starts `pyserve serve MODEL FLAGS` (no MODEL when `model_dir` is None: the embedded default)
    on a free loopback port and returns once /health answers.

    It runs from `workdir`, outside the repository, so the installed package (with its native
    module) is imported, and logs to a file there: an unread pipe would fill up and block it.
    """
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = [] if model_dir is None else [str(model_dir)]
    cmd = [sys.executable, "-m", "pyserve.cli", "serve", *model, "--port", str(port), *flags]
    log_path = Path(workdir) / f"server-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError("server did not start within 120 s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (the server drains), then its exit code; killed if it does not stop in 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {series: value}; a series is its name with its labels, as written
    (`pyserve:request_outcomes_total{outcome="ok"}`)."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def scrape_metrics(base: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics, parsed."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return parse_metrics(httpx.get(base + "/metrics", headers=headers, timeout=30).text)


CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語 text.\n",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
}


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
    }))


def build_model(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Saves a tiny random model of `arch` with the test tokenizer to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    fields = dict(ARCH_CONFIGS[arch])
    model_type = fields.pop("model_type")
    params = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        initializer_range=0.3, tie_word_embeddings=False,
    )
    params.update(fields)
    params.update(overrides)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]
