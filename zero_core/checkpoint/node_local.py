"""Node-local checkpoints (DeepSpeed's ``checkpoint.use_node_local_storage``): no file system shared by the nodes.

Every node writes the same path on its own disk: its ranks' shard files, and (from the node's first rank) the
replicated state, the client state and a manifest. A node's manifest describes every fragment of the checkpoint
but lists only the files in its own directory, under ``"node_local": {"node", "nodes", "save_id"}``; so a node
directory verifies on its own, and resuming on the same topology reads each node's own files. ``gather`` joins
the node directories into one ordinary checkpoint, which then reshards and consolidates like any other.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from zero_core.checkpoint.collective import gather_json
from zero_core.checkpoint.files import atomic_directory
from zero_core.checkpoint.format import MANIFEST, CheckpointError, PathLike, read_manifest, write_json
from zero_core.checkpoint.verify import verify_files

NODE_LOCAL = "node_local"  # the manifest key of a node directory


@dataclass(frozen=True)
class NodePlace:
    """Where this rank sits among the ranks that write the checkpoint (the shard group)."""

    node: int  # this rank's node, numbered 0.. in order of the nodes' first ranks
    nodes: int
    ranks: tuple  # the group ranks on this node, ascending; the first one writes the node's shared files

    @property
    def first(self) -> int:
        return self.ranks[0]


def node_place(engine) -> NodePlace:
    """This rank's node and its node's ranks, agreed by all ranks of the group (a collective)."""
    import torch.distributed as dist

    mine = engine.topology.node_of.get(dist.get_rank(), 0)
    of_rank = gather_json(engine, mine)  # group rank -> node index of the launcher's numbering
    order = {key: i for i, key in enumerate(dict.fromkeys(of_rank))}
    node = order[mine]
    ranks = tuple(r for r, key in enumerate(of_rank) if order[key] == node)
    return NodePlace(node=node, nodes=len(order), ranks=ranks)


def probe_name(path: Path, token: str, node: int) -> Path:
    return path.parent / f".{path.name}.node-{token}-{node}"


def leave_probe(path: Path, token: str, place: NodePlace, leader: bool) -> None:
    """Each node's first rank marks the parent directory, so that the next step can see whether it is shared."""
    if leader:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe_name(path, token, place.node).touch()


def check_not_shared(path: Path, token: str, place: NodePlace, leader: bool) -> None:
    """Raise if this node sees another node's mark: the nodes would overwrite each other's manifests. (Of two
    nodes on one file system, the first to look always sees the other's mark, which is removed only later.)"""
    if not leader:
        return
    own = probe_name(path, token, place.node)
    seen = [n for n in range(place.nodes) if n != place.node and probe_name(path, token, n).exists()]
    own.unlink(missing_ok=True)
    if seen:
        raise CheckpointError(
            f"checkpoint.use_node_local_storage is on, but '{path.parent}' is shared with node(s) {seen}: every "
            "node would write its own manifest there. Turn use_node_local_storage off on a shared file system, or "
            "save to a path on each node's local disk")


def check_loadable_here(manifest: dict, path: Path, place: NodePlace, world_size: int) -> None:
    """A node directory holds this node's files only: it loads on the topology that wrote it, as this node."""
    info = manifest.get(NODE_LOCAL)
    if info is None:
        return
    saved_world = manifest["run"]["world_size"]
    if (info["nodes"], info["node"], saved_world) != (place.nodes, place.node, world_size):
        raise CheckpointError(
            f"'{path}' is node {info['node']}'s directory of a node-local checkpoint saved by {saved_world} ranks on "
            f"{info['nodes']} node(s); this rank is on node {place.node} of {place.nodes} with {world_size} ranks. "
            "Gather the node directories first (zero-checkpoint gather NODE_DIR... --out DIR), then load DIR")


def require_whole(manifest: dict, path: PathLike) -> None:
    """Offline readers need every shard: a node directory holds only its node's."""
    info = manifest.get(NODE_LOCAL)
    if info is not None:
        raise CheckpointError(
            f"'{path}' is only node {info['node']}'s directory of a node-local checkpoint ({info['nodes']} nodes); "
            "gather the node directories first: zero-checkpoint gather NODE_DIR... --out DIR, then use DIR")


def files_to_verify(manifest: dict, place: NodePlace, rank: int) -> list:
    """A node directory's files are split between the node's own ranks, so each is read once."""
    return sorted(manifest["files"])[place.ranks.index(rank)::len(place.ranks)]


def gather(node_dirs: Sequence[PathLike], out: PathLike, verify: bool = True) -> Path:
    """Join the directories a node-local save wrote on each node (copied to one machine) into one checkpoint at
    ``out``. Every file is checked against its node's manifest first (``verify=False``: sizes only); the
    result is published atomically, like a save. No process group needed."""
    out = Path(out).absolute()
    manifests = {Path(d): read_manifest(d) for d in node_dirs}
    by_node = _check_one_save(manifests)
    first_dir, first = by_node[0]
    files = {}
    for directory, manifest in by_node.values():
        verify_files(directory, manifest, sorted(manifest["files"]), checksum=verify)
        shards = {name: entry for name, entry in manifest["files"].items() if name.startswith("shard-")}
        files.update({name: (directory, entry) for name, entry in shards.items()})
    files.update({name: (first_dir, entry) for name, entry in first["files"].items()})  # node 0: rank 0's state
    _check_complete(first, files)
    merged = {k: v for k, v in first.items() if k != NODE_LOCAL}
    merged["files"] = {name: entry for name, (_, entry) in sorted(files.items())}
    with atomic_directory(out, token=first[NODE_LOCAL]["save_id"]) as temp:
        for name, (directory, _) in files.items():
            shutil.copyfile(directory / name, temp / name)
        verify_files(temp, merged, sorted(merged["files"]), checksum=False)  # the copies are whole
        write_json(temp / MANIFEST, merged)
    return out


def _check_one_save(manifests: dict) -> dict:
    """node index -> (directory, manifest): one directory per node, all from the same save."""
    by_node = {}
    for directory, manifest in manifests.items():
        info = manifest.get(NODE_LOCAL)
        if info is None:
            raise CheckpointError(f"'{directory}' is not a node directory of a node-local checkpoint (its manifest "
                                  "has no node_local entry); it is already a whole checkpoint")
        if info["node"] in by_node:
            raise CheckpointError(f"'{directory}' and '{by_node[info['node']][0]}' are both node {info['node']}'s "
                                  "directory; give each node's directory once")
        by_node[info["node"]] = (directory, manifest)
    first = next(iter(by_node.values()))[1][NODE_LOCAL]
    for directory, manifest in by_node.values():
        if manifest[NODE_LOCAL]["save_id"] != first["save_id"] or manifest[NODE_LOCAL]["nodes"] != first["nodes"]:
            raise CheckpointError(f"'{directory}' is from another save than the other node directories (their "
                                  "save ids differ); give the directories of one save")
    missing = sorted(set(range(first["nodes"])) - set(by_node))
    if missing:
        raise CheckpointError(f"the checkpoint was saved by {first['nodes']} nodes; the directories of node(s) "
                              f"{missing} are missing")
    return by_node


def _check_complete(manifest: dict, files: dict) -> None:
    needed = {fragment["file"] for param in manifest["parameters"] for fragment in param["fragments"]}
    absent = sorted(needed - set(files))
    if absent:
        raise CheckpointError(f"no node directory lists {absent}: the node directories do not hold the whole "
                              "checkpoint")
