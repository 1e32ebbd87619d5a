"""A version checked before it is served: from a path (a Hub id resolved once) or pushed tensors, against
every node's spec, sized for every node's host tier, and agreed by every rank.

Each rank brings what its own check gave, a version or why not, to one collective that every rank makes
whatever happened to it: so a rank whose check failed fails the registration everywhere, with its reason,
instead of leaving the others waiting in the collective.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import hub, objects, urls
from .check import check_checkpoint
from .checkpoint import Checkpoint, open_checkpoint, refusal
from .disk_tier import DiskTier, default_tier
from .memory import WHERE, tensor_checkpoint
from .objects import Remote
from .plan import host_bytes
from .ranks import same_everywhere
from .registry import Version
from .store import LoraAdapterStore

Checked = Version | str  # a version, or why the check refused it


def check_path(stores: Mapping[str, LoraAdapterStore], name: str, path: str | os.PathLike[str] | Remote,
               hash_threads: int | None = None, disk: Callable[[], DiskTier] | None = None) -> Checked:
    """name's version at path (a Hub id pinned to the commit it resolves to; an object-store URL pinned to
    its objects' ETags and fetched into the disk tier disk() gives), checked and sized from one open
    checkpoint, or why not."""
    def check() -> Version:
        if objects.is_remote(path):
            try:
                remote = path if isinstance(path, Remote) else objects.pin(path)
            except ValueError as e:  # the URL as it may be shown: it may carry a secret
                raise refusal(name, str(path) if isinstance(path, Remote) else urls.redacted(path), [str(e)]) from None
            tier = (disk or default_tier)()
            try:
                with tier.local(remote) as local:
                    return dataclasses.replace(checked(local), path=remote)
            except ValueError as e:  # named by its URL, not by where the disk tier keeps it
                raise named(e, name, remote, tier) from None
        try:
            resolved = hub.resolve(path)
        except ValueError as e:
            raise refusal(name, path, [str(e)]) from None
        return checked(resolved)

    def checked(resolved: os.PathLike[str]) -> Version:
        with open_checkpoint(resolved, name) as ckpt:
            kw = {} if hash_threads is None else {"hash_threads": hash_threads}
            digest = _check(stores, ckpt, **kw)
            return _fits(stores, Version(name, resolved, digest, nbytes=_sizes(stores, ckpt)))

    return _attempt(name, check)


def named(e: ValueError, name: str, remote: Remote, tier: DiskTier) -> ValueError:
    """e as a refusal naming the adapter and its URL where the disk tier's folder for it (or its download's
    temporary one) would stand; a lock file (which another process holds, say) is named as it is."""
    text = re.sub(re.escape(str(tier.home)) + r"/\.?[0-9a-f]{32}(?:\.part)?(?!\.lock)", remote.url.rstrip("/"), str(e))
    return ValueError(text) if text.startswith(f"adapter {name!r}") else refusal(name, remote.url, [text])


def check_pushed(stores: Mapping[str, LoraAdapterStore], name: str, tensors: Mapping[str, torch.Tensor],
                 config: Any) -> Checked:
    """name's version of pushed tensors, checked and digested as the same weights saved as a file, or why not."""
    def check() -> Version:
        ckpt = tensor_checkpoint(name, tensors, config)
        digest = _check(stores, ckpt)
        return _fits(stores, Version(name, None, digest, dict(tensors), config, _sizes(stores, ckpt)))

    return _attempt(name, check)


def agree(checked: Mapping[str, Checked], group: dist.ProcessGroup | None) -> dict[str, Version]:
    """The checked versions, once every rank of group has checked each alike; else a ValueError, raised on
    every rank, naming each adapter that failed on some rank, or whose ranks read different weights."""
    mine = {n: v.digest if isinstance(v, Version) else v for n, v in checked.items()}
    result = outcome(checked, same_everywhere(mine, group))
    if isinstance(result, ValueError):
        raise result
    return result


def outcome(checked: Mapping[str, Checked], everyone: Sequence[Mapping[str, bytes | str]]) -> dict[str, Version] \
        | ValueError:
    """This rank's checked versions, if every rank's check (everyone: each rank's digest or refusal per
    name) gave each the same digest; else a ValueError naming each adapter that failed on some rank, or
    whose ranks read different weights. Every rank computes the same answer from the same gathered checks."""
    failures = []
    for name in checked:
        seen = [theirs.get(name) for theirs in everyone]
        why = next((w for w in seen if isinstance(w, str)), None)
        if why is not None:
            failures.append(why)
        elif len(set(seen)) != 1:
            failures.append(f"adapter {name!r} ({checked[name].path}): the ranks read different weights there "
                            f"(digests {', '.join(d.hex()[:16] if d else 'none' for d in seen)})")
    if failures:
        if len(checked) == 1:
            return ValueError(failures[0])
        return ValueError(f"{len(failures)} of {len(checked)} adapters cannot be served:\n" + "\n".join(failures))
    return dict(checked)


def _check(stores: Mapping[str, LoraAdapterStore], ckpt: Checkpoint, **kw: Any) -> bytes:
    specs = [s.spec for s in stores.values()]
    return check_checkpoint(specs[0], ckpt, specs[1:], **kw)


def _sizes(stores: Mapping[str, LoraAdapterStore], ckpt: Checkpoint) -> dict[str, int]:
    return {n: host_bytes(ckpt, s.layout) for n, s in stores.items()}


def _fits(stores: Mapping[str, LoraAdapterStore], v: Version) -> Version:
    """v, if its copy fits each node's host budget on its own: one that never could would wait forever."""
    for n, s in stores.items():
        if s.max_bytes is not None and v.nbytes[n] > s.max_bytes:
            raise refusal(v.name, v.path or WHERE, [
                f"its copy takes {v.nbytes[n]} host bytes for {n}, over the host budget of {s.max_bytes}"])
    return v


def _attempt(name: str, check: Callable[[], Version]) -> Checked:
    """check()'s result, or why it failed: what a rank brings to a collective whatever happened to it."""
    try:
        return check()
    except ValueError as e:
        return str(e)
    except Exception as e:  # a rank that raised anything else must still make the collective
        return f"adapter {name!r}: its check failed ({e!r})"
