"""Model names that are Hugging Face Hub ids (`ORG/NAME`, `ORG/NAME:FILE.gguf`), downloaded with
`huggingface_hub` into its standard cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE are its own), and only the files a model needs: safetensors weights, JSON configs,
tokenizer files and the chat template, or the one GGUF file named. Pickled weights are never
fetched: a repository that has only those is refused."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pyserve.model.errors import WeightsError

HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<file>[^/\\:]+\.gguf))?")
NEEDED = ["*.safetensors", "*.json", "tokenizer.model", "*.jinja", "merges.txt", "vocab.txt"]
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class HubError(ValueError):
    """A hub id that cannot be served: missing, gated, unreachable, or without safetensors."""


def is_hub_id(model: str) -> bool:
    return not Path(model).exists() and HUB_ID.fullmatch(model) is not None


def fetch_model(model: str, revision: str | None, gguf_file: str | None) -> str:
    """The local path of `model`: itself when it exists (`gguf_file` then names a file in it), else
    the download of the hub id (a GGUF file's path where one is named)."""
    path = Path(model)
    if path.exists():
        if gguf_file is not None:
            if not path.is_dir():
                raise WeightsError(f"gguf_file names a file inside a folder or hub repository; the model {model} "
                                   "is a file itself: serve it without gguf_file")
            if not (path / gguf_file).is_file():
                raise WeightsError(f"gguf_file: no {gguf_file} in {model}")
            return str(path / gguf_file)
        return model
    repo, gguf_file = _repo_and_file(model, gguf_file)
    return download(repo, revision, gguf_file)


def _repo_and_file(hub_id: str, gguf_file: str | None) -> tuple[str, str | None]:
    """The repository a hub id names and the GGUF file it or `gguf_file` names (None: neither)."""
    m = HUB_ID.fullmatch(hub_id)
    if m is None:
        raise FileNotFoundError(f"model: {hub_id!r} is neither a local path nor a hub id (ORG/NAME)")
    if m.group("file") and gguf_file and m.group("file") != gguf_file:
        raise ValueError(f"gguf_file {gguf_file!r} differs from the file the model names ({m.group('file')!r})")
    return m.group("repo"), m.group("file") or gguf_file


def check_hub_model(model: str, revision: str | None, gguf_file: str | None) -> None:
    """A hub id checked by one metadata request before the server binds its socket (its files are
    fetched behind it): a repository or revision the hub does not have, one without the weights
    pyserve loads (safetensors, or the GGUF file named), or a hub that cannot be reached while the
    cache lacks the files, is a HubError at once. Each refusal is `download`'s own: run at once
    where the request failed (from the cache alone where the hub did not answer, as
    snapshot_download falls back to it) or the listing lacks the weights."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo, gguf_file = _repo_and_file(model, gguf_file)
    try:
        info = HfApi().repo_info(repo, revision=revision, timeout=5)
    except HfHubHTTPError:  # the hub answered: its answer, as the download reads it
        download(repo, revision, gguf_file)
        return
    except Exception:  # noqa: BLE001 - no answer (offline, refused, timed out): the cache alone
        download(repo, revision, gguf_file, local_only=True)
        return
    names = {s.rfilename for s in info.siblings or ()}
    if gguf_file not in names if gguf_file else not any(n.endswith(".safetensors") for n in names):
        download(repo, revision, gguf_file)


@lru_cache(maxsize=16)
def download(repo: str, revision: str | None, gguf_file: str | None, local_only: bool = False) -> str:
    """The repository's needed files in the hub cache (fetched if missing; from the cache alone
    where `local_only`): its snapshot folder, or the GGUF file's path. A process resolves each
    (repo, revision, file) once: the server's start downloads before it builds the engine, which
    asks again (a failure is not kept)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    patterns = [gguf_file] if gguf_file else NEEDED
    where = f"{repo}" + (f" at revision {revision}" if revision else "")
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, etag_timeout=5,
                                        local_files_only=local_only))
    except GatedRepoError:
        raise HubError(f"{where} is gated: accept its terms on the hub and set HF_TOKEN to a token that may "
                       "read it") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where} was not found on the hub (or is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{where} is not in the local hub cache and the hub cannot be reached (HF_HUB_OFFLINE "
                       "is set, or the network is down)") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{where}: the hub could not be reached: {e}") from None
    if gguf_file:
        path = folder / gguf_file
        if not path.is_file():
            raise HubError(f"{where} has no file {gguf_file}")
        return str(path)
    if not any(folder.glob("*.safetensors")):
        raise HubError(f"{where} has no safetensors weights; pyserve does not load pickled weights ("
                       f"{', '.join(PICKLES)}), since unpickling can run arbitrary code. Name a GGUF file "
                       "(ORG/NAME:FILE.gguf) or a repository with safetensors.")
    return str(folder)
