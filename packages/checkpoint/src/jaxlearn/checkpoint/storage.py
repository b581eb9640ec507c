"""Where a run's files live: a local directory or an object-store URI (`s3://`, `gs://`).

    root = storage.resolve("s3://bucket/runs/a")   # checks the backend, then an epath.Path
    (root / "metrics.jsonl").write_text(...)       # one PUT: the object appears whole

Object stores are reached through libraries that already speak them: etils `epath`
(fsspec with `s3fs` / `gcsfs`) for files, tensorstore's own `s3` / `gcs` drivers for the
arrays orbax writes. `resolve` fails at once, in one line naming the URI, when the
backend package, the credentials or the bucket is missing, instead of a traceback from
deep inside the first write. Endpoint and region of S3 come from the standard
`AWS_ENDPOINT_URL[_S3]` and `AWS_REGION` / `AWS_DEFAULT_REGION` variables (an
S3-compatible server: MinIO, moto), credentials from botocore's usual chain.

orbax 0.12 builds tensorstore specs for `gs://` and local paths only; `install_orbax_s3`
(called by `resolve` for `s3://`) wraps its two spec builders so an `s3://` directory
gets tensorstore's `s3` driver, everything else unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Union
from urllib.parse import urlparse

from etils import epath  # type: ignore[import-untyped]

SCHEMES = ("s3", "gs")
# A local pathlib.Path, or an epath.Path of an object store.
StoragePath = Union[Path, Any]

_BACKEND_PACKAGE = {"s3": "s3fs", "gs": "gcsfs"}


class StorageError(OSError):
    """An object-store URI that cannot be used (backend, credentials, bucket)."""


def is_remote(path: Union[str, os.PathLike[str], Any]) -> bool:
    """Whether `path` names an object store (`s3://...`, `gs://...`)."""
    text = str(path)
    return any(text.startswith(f"{s}://") for s in SCHEMES)


def split_uri(uri: str) -> tuple[str, str, str]:
    """`s3://bucket/a/b` -> ("s3", "bucket", "a/b"); a bad URI raises StorageError."""
    parsed = urlparse(uri)
    if parsed.scheme not in SCHEMES:
        raise StorageError(f"{uri}: not an object-store URI (want one of "
                           f"{', '.join(s + '://' for s in SCHEMES)})")
    if not parsed.netloc:
        raise StorageError(f"{uri}: no bucket name (want {parsed.scheme}://BUCKET/PATH)")
    return parsed.scheme, parsed.netloc, parsed.path.strip("/")


def resolve(path: Union[str, os.PathLike[str]], *, check: bool = True) -> StoragePath:
    """A local absolute `Path`, or an `epath.Path` of an object store whose backend was
    checked (`check=True`): package installed, credentials found, bucket reachable."""
    if not is_remote(path):
        return Path(path).absolute()
    uri = str(path).rstrip("/")
    scheme, _, _ = split_uri(uri)
    if check:
        check_backend(uri)
    if scheme == "s3":
        install_orbax_s3()
    return epath.Path(uri)


def join(path: Union[str, os.PathLike[str]], *names: str) -> str:
    """`os.path.join` that keeps a URI a URI (`s3://b/run` + `x` -> `s3://b/run/x`)."""
    text = str(path)
    if is_remote(text):
        return "/".join([text.rstrip("/"), *names])
    return os.path.join(text, *names)


def local_dir(path: Union[str, os.PathLike[str]]) -> str:
    """A local directory for the files of `path` that only make sense on this machine
    (hang dumps, goodput spans, profiler traces): `path` itself when it is local, else
    `$JAXLEARN_LOCAL_DIR/<scheme>/<bucket>/<path>` (default root
    `~/.cache/jaxlearn/remote`), the same for every run of one URI."""
    if not is_remote(path):
        return str(path)
    scheme, bucket, key = split_uri(str(path))
    root = os.environ.get("JAXLEARN_LOCAL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxlearn", "remote")
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    return os.path.join(root, scheme, bucket, *parts)


@functools.lru_cache(maxsize=64)
def check_backend(uri: str) -> None:
    """Raises StorageError (one line naming `uri` and what is missing) unless the store
    can be used: the fsspec backend package, credentials, and the bucket."""
    import fsspec  # type: ignore[import-untyped]

    scheme, bucket, _ = split_uri(uri)
    package = _BACKEND_PACKAGE[scheme]
    if importlib.util.find_spec(package) is None:
        raise StorageError(f"{uri}: {scheme}:// needs the {package} package, which is not "
                           f"installed (pip install {package})")
    if scheme == "s3":
        fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs={
            "connect_timeout": 10, "read_timeout": 30, "retries": {"max_attempts": 2}})
        endpoint = s3_endpoint() or "AWS"
    else:
        fs = fsspec.filesystem("gs", skip_instance_cache=True)
        endpoint = "GCS"
    try:
        fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        raise StorageError(f"{uri}: bucket {bucket!r} does not exist") from None
    except PermissionError as e:
        raise StorageError(f"{uri}: access to bucket {bucket!r} denied ({_first_line(e)})"
                           ) from None
    except Exception as e:  # Credentials, connection refused, DNS, ...
        name = type(e).__name__
        if name == "NoCredentialsError":  # botocore's
            raise StorageError(f"{uri}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)"
                               ) from None
        if name in ("DefaultCredentialsError", "RefreshError"):  # google-auth's
            raise StorageError(f"{uri}: no usable Google Cloud credentials (run `gcloud auth "
                               "application-default login` or set "
                               "GOOGLE_APPLICATION_CREDENTIALS)") from None
        raise StorageError(f"{uri}: cannot reach bucket {bucket!r} at {endpoint} "
                           f"({name}: {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def s3_endpoint() -> str | None:
    """The S3 endpoint URL from the environment (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_kvstore(bucket: str, path: str) -> dict[str, Any]:
    """tensorstore's `s3` kvstore spec for `s3://bucket/path`, endpoint/region from env."""
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = s3_endpoint()
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        # Straight from the environment: the default chain logs a line per missing file.
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _gcs_specs_to_s3(spec: Any) -> Any:
    """Every `{"driver": "gcs", bucket, path}` inside `spec` becomes the s3 equivalent."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return s3_kvstore(spec["bucket"], spec["path"])
        return {k: _gcs_specs_to_s3(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_gcs_specs_to_s3(v) for v in spec]
    return spec


def _s3_aware(build: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build)
    def wrapped(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if not text.startswith("s3://"):
            return build(directory, *args, **kwargs)
        # Built as for GCS (the same bucket/path split), then pointed at S3.
        return _gcs_specs_to_s3(build("gs://" + text[len("s3://"):], *args, **kwargs))

    wrapped.__jaxlearn_s3__ = True  # type: ignore[attr-defined]
    return wrapped


@functools.lru_cache(maxsize=1)
def install_orbax_s3() -> None:
    """Makes orbax's tensorstore specs of `s3://` directories use the `s3` driver."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    for name in ("_build_ocdbt_kvstore_tspec", "_build_non_ocdbt_kvstore_tspec"):
        build = getattr(ts_utils, name)
        if not getattr(build, "__jaxlearn_s3__", False):
            setattr(ts_utils, name, _s3_aware(build))


# ---- object-store file operations (fsspec; local paths use os/pathlib instead) ---------


def _fs(path: Any) -> tuple[Any, str]:
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(path))
    return fs, key.rstrip("/")


def list_files(path: Any) -> dict[str, int]:
    """{relative posix path: size} of every object below `path` (one recursive listing,
    never served from a stale cache: tensorstore writes bypass fsspec)."""
    fs, key = _fs(path)
    fs.invalidate_cache()
    try:
        found = fs.find(key, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    for name, info in found.items():
        name = name.rstrip("/")
        if info.get("type") == "directory" or not name.startswith(key + "/"):
            continue
        out[name[len(key) + 1:]] = int(info["size"])
    return out


def list_dirs(path: Any) -> list[str]:
    """Names of the "directories" (common prefixes) directly below `path`."""
    fs, key = _fs(path)
    fs.invalidate_cache()
    try:
        entries = fs.ls(key, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries
                  if e.get("type") == "directory")


def remove_tree(path: Any) -> None:
    """Deletes every object below `path` (nothing there: no error)."""
    fs, key = _fs(path)
    if list_files(path):
        fs.rm(key, recursive=True)
    fs.invalidate_cache()


def copy_tree(src: Any, dst: Any) -> None:
    """Copies every object below `src` to the same relative name below `dst`."""
    fs, src_key = _fs(src)
    _, dst_key = _fs(dst)
    for rel in list_files(src):
        fs.copy(f"{src_key}/{rel}", f"{dst_key}/{rel}")
    fs.invalidate_cache()


def write_text(path: Union[str, os.PathLike[str]], text: str) -> None:
    """Writes a whole text file: a local file, or one PUT of an object."""
    if is_remote(path):
        resolve(path, check=False).write_text(text)
    else:
        with open(path, "w") as f:
            f.write(text)
