"""One folder level of an S3 bucket by presigned ListObjectsV2 requests (no s3fs).

``FsspecBlobStore.children`` uses this when it signs URLs itself (``local_presigner``):
a store that only restores from the mirror then never creates s3fs's aiobotocore client,
whose first call cost a fresh store ~0.05 s of CPU (most of the time a restore from the
mirror spent finding its manifest). Same answer as the s3fs listing: the names right
below ``base`` (objects and common prefixes, ``delimiter=/``), sorted; a missing bucket
or prefix lists nothing. Pages of up to 1000 keys are followed by continuation token.
"""

from __future__ import annotations

import builtins
import xml.etree.ElementTree as ET

from isolane.errors import StorageError
from isolane.storage.s3_ranged import QuerySigner, RangedGetter

MAX_LISTING_BYTES = 16 << 20  # of one ListObjectsV2 page (1000 keys: ~0.3 MB)
MAX_LISTING_PAGES = 10_000  # a server that keeps answering "truncated" is stopped
PAGE_KEYS = 1000  # keys per ListObjectsV2 page (the S3 maximum)


def list_children(getter: RangedGetter, sign: QuerySigner, base: str, url: str
                  ) -> builtins.list[str]:
    """The names right below the folder ``base`` (``bucket/key/prefix``); ``url``
    names the store in errors."""
    bucket, _, rest = base.partition("/")
    prefix = f"{rest}/" if rest else ""
    names: set[str] = set()
    token: str | None = None
    for _page in range(MAX_LISTING_PAGES):
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/",
                 "max-keys": str(PAGE_KEYS)}
        if token is not None:
            query["continuation-token"] = token
        status, body = getter.fetch(sign(bucket, query), f"the listing of {url}/{rest}",
                                    MAX_LISTING_BYTES)
        if status == 404:  # no such bucket: nothing below it, as s3fs lists it
            return []
        if status >= 300:
            raise refused("list", f"{url}/{rest}", status, body)
        keys, truncated, token = parse_listing(body, f"{url}/{rest}")
        for key in keys:
            if key.startswith(prefix):
                name = key[len(prefix):].rstrip("/")
                if name and "/" not in name:
                    names.add(name)
        if not truncated:
            return sorted(names)
        if not token:
            raise StorageError(f"the listing of {url}/{rest} is truncated but names no "
                               "continuation token; is the server S3 compatible?")
    raise StorageError(f"the listing of {url}/{rest} did not end after "
                       f"{MAX_LISTING_PAGES} pages")


def parse_listing(body: bytes, where: str) -> tuple[builtins.list[str], bool, str | None]:
    """(object keys and common prefixes, truncated, next continuation token) of one
    ListObjectsV2 answer. Expat rejects external entities and caps entity expansion."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise StorageError(f"the listing of {where} is not S3 XML ({exc})") from None
    keys: builtins.list[str] = []
    truncated, token = False, None
    for child in root:
        tag = _local(child.tag)
        if tag in ("Contents", "CommonPrefixes"):
            for field in child:
                if _local(field.tag) in ("Key", "Prefix") and field.text:
                    keys.append(field.text)
        elif tag == "IsTruncated":
            truncated = (child.text or "").strip().lower() == "true"
        elif tag == "NextContinuationToken":
            token = child.text
    return keys, truncated, token


def refused(op: str, where: str, status: int, body: bytes) -> StorageError:
    """The error of an S3 answer that is neither a success nor a 404."""
    text = body.decode("utf-8", "replace").strip()[:300]
    if status == 403:
        return StorageError(f"{op} {where} was refused (HTTP 403: {text}); check the "
                            "credentials in storage_options (key/secret) and the bucket "
                            "policy")
    return StorageError(f"{op} {where} answered HTTP {status}: {text}")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]
