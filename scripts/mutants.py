"""The curated mutants scripts/mutate.py applies, one at a time: small changes a real bug could look like, in the
modules that decide served weights and guarantees. Each names the bug by what it would serve, so a mutant whose
code was rewritten (plan.py and reader.py become a compiled plan) can be given a new anchor for the same bug.

find must match exactly once in its module (a literal, or a regex with regex=True); replace takes its place.
equivalent, where set, says why a surviving mutant serves exactly what the original does.
"""

from __future__ import annotations

from typing import NamedTuple

PACKAGE = "mstar.engine.resources.lora"


class Mutant(NamedTuple):
    id: str
    module: str
    find: str
    replace: str
    bug: str
    tests: tuple[str, ...] = ()  # test files beyond the module's own (TESTS)
    regex: bool = False
    equivalent: str | None = None


T = "tests/test_"
READS = (f"{T}numerics.py", f"{T}buffer_reuse.py", f"{T}bf16_files.py", f"{T}layout_addresses.py", f"{T}store.py",
         f"{T}pattern_order.py", f"{T}sharding.py", f"{T}sources.py", f"{T}slot_ranks.py", f"{T}experts.py",
         f"{T}digest_covers.py", f"{T}expert_folds.py")
TESTS: dict[str, tuple[str, ...]] = {
    "spec.py": (f"{T}sharding.py", f"{T}numerics.py", f"{T}model_configs.py", f"{T}integrity.py", f"{T}check.py"),
    "layout.py": (f"{T}layout_addresses.py", f"{T}store.py", f"{T}numerics.py", f"{T}pool.py", f"{T}sharding.py"),
    "plan.py": READS,
    "reader.py": (*READS, f"{T}rewritten_in_place.py", f"{T}integrity.py", f"{T}races.py"),
    "digest.py": (f"{T}digest.py", f"{T}digest_covers.py", f"{T}sources.py", f"{T}integrity.py", f"{T}races.py"),
    "store.py": (f"{T}store.py", f"{T}sources.py", f"{T}buffer_reuse.py", f"{T}races.py", f"{T}pool.py"),
    "pool.py": (f"{T}pool.py", f"{T}pool_slots.py", f"{T}slot_ranks.py", f"{T}layout_addresses.py"),
    "manager.py": (f"{T}manager.py", f"{T}manager_admission.py", f"{T}manager_properties.py", f"{T}metrics.py",
                   f"{T}manager_ranks.py"),
    "source.py": (f"{T}digest_covers.py", f"{T}sources.py", f"{T}races.py", f"{T}integrity.py",
                  f"{T}rewritten_in_place.py", f"{T}pushed_memory.py"),
    "versions.py": (f"{T}manager.py", f"{T}manager_admission.py", f"{T}manager_ranks.py"),
    "ranks.py": (f"{T}ranks_agree.py", f"{T}manager_ranks.py"),
    "adapter_config.py": (f"{T}pattern_order.py", f"{T}config_scope.py", f"{T}config_values.py", f"{T}numerics.py",
                          f"{T}check.py", f"{T}hostile_configs.py", f"{T}integrity.py", f"{T}sources.py"),
    "patterns.py": (f"{T}pattern_order.py", f"{T}hostile_configs.py", f"{T}numerics.py"),
    "check.py": (f"{T}check.py", f"{T}config_scope.py", f"{T}refusal_messages.py", f"{T}hostile_adapters.py",
                 f"{T}integrity.py", f"{T}numerics.py"),
    "experts.py": (f"{T}experts.py", f"{T}expert_folds.py", f"{T}expert_configs.py", f"{T}experts_transformers4.py"),
    **{f"models/{m}.py": (f"{T}derived_rules.py", f"{T}derived_builders.py", f"{T}derived_sweep.py")
       for m in ("sites", "rules", "derived")},
}

M = Mutant
MUTANTS: list[Mutant] = [
    # --- the survivors (issue 21) ---
    M("reader.reused-dense-padding-kept", "reader.py",
      r"^(\s*)for d in p\.dense:\n(\s*)a, b = views\[d\.target\]\n\s*a\.view\(.*\n\s*b\[\.\.\., d\.rank :\]\.zero_\(\)",
      r"\1pass", "a reused buffer keeps the last adapter's weights in a dense target's rank padding", regex=True),
    M("patterns.last-plain-key-wins", "patterns.py", "(best is None or i < best)", "(best is None or i > best)",
      "rank_pattern / alpha_pattern: the last matching plain key wins, not the first"),
    M("adapter_config.last-key-wins", "adapter_config.py",
      "(values, patterns.PatternKeys(list(values)), list(values.values()))",
      "(values, patterns.PatternKeys(list(values)[::-1]), list(values.values())[::-1])",
      "rank_pattern / alpha_pattern: the last matching key wins"),
    M("check.layers-to-transform-ignored", "check.py",
      "if config is not None and not config.transforms_layer(module):", "if False:",
      "a module outside layers_to_transform is served, though PEFT drops it"),
    M("digest.no-dtype", "digest.py", "[module, role, e.dtype, list(e.shape), scaling]",
      "[module, role, list(e.shape), scaling]", "the same bytes as BF16 and as F16 share a digest"),
    M("digest.file-order", "digest.py",
      "order = [e for _, keys in modules for _, e in sorted(keys.roles.items())]",
      "order = sorted((e for _, keys in modules for _, e in keys.roles.items()), key=lambda e: e.start)",
      "bytes hashed in file order: one adapter laid out two ways digests two ways"),
    M("pool.most-recent-slot", "pool.py", "for slot in self._recent:", "for slot in reversed(self._recent):",
      "a slot is reused most recent first: an adapter is evicted while a slot is empty"),
    M("layout.b-offset-unaligned", "layout.py",
      "return aligned(math.prod(self.a_shape) * self.dtype.itemsize) // self.dtype.itemsize",
      "return math.prod(self.a_shape)", "b starts right after a, off the alignment"),
    M("plan.skew-sign", "plan.py", r"weight\[\((\w+)\.at - \1\.to\) % SKEW\]", r"weight[(\1.to - \1.at) % SKEW]",
      "direct reads land off the file's alignment modulo SKEW (slow copies)", regex=True),

    # --- reader.py: where bytes go and how scalings fold (by behaviour; anchors on stable names) ---
    M("reader.reused-partial-kept", "reader.py", "blocks[name].zero_()", "pass",
      "a reused buffer keeps the last adapter's weights in blocks the pieces do not fill"),
    M("reader.reused-never-zeroed", "reader.py", "if not fresh:", "if False:",
      "a reused buffer is never zeroed"),
    M("reader.staged-fold-dropped", "reader.py", "_fold(views, r.piece, _rows(stage, r), ratios[r.piece.module])",
      "_copy_piece(views, r.piece, _rows(stage, r))", "a module's own scaling is not folded into a staged B"),
    M("reader.direct-fold-dropped", "reader.py", "_fold(views, r.piece, None, ratios[r.piece.module])", "pass",
      "a module's own scaling is not folded into a B read straight into place"),
    M("reader.whole-fold-dropped", "reader.py", "b[layer].copy_(b[layer].float() * ratio)", "pass",
      "a target whose modules share one scaling of their own serves it unfolded"),
    M("reader.fold-in-file-dtype", "reader.py", "dst.copy_((dst if rows is None else rows).float() * ratio)",
      "dst.copy_((dst if rows is None else rows) * ratio)",
      "a fold is computed in the file's dtype (bf16) instead of float32: rounded twice"),
    M("reader.stacked-fold-dropped", "reader.py", "rows[:, r0:r1] if ratio == 1.0 else rows[:, r0:r1].float() * ratio",
      "rows[:, r0:r1]", "stacked experts with a scaling of their own are served unfolded"),
    M("reader.stacked-orientation-swapped", "reader.py", "if st.orientation == \"A in\":",
      "if st.orientation != \"A in\":", "stacked experts' A read from the wrong side"),
    M("reader.stacked-interleave-ignored", "reader.py",
      "rows = up[:, j::per] if t.experts.interleaved else up[:, j * width : (j + 1) * width]",
      "rows = up[:, j * width : (j + 1) * width]", "gpt-oss's interleaved gate/up rows read as if consecutive"),
    M("plan.node-scaling-least-common", "plan.py", "return max(nonzero, key=lambda s: (nonzero[s], -s))",
      "return min(nonzero, key=lambda s: (nonzero[s], -s))",
      "the slots take the least common scaling: most modules fold, rounding in a bf16 store"),
    M("plan.node-scaling-tie-larger", "plan.py", "key=lambda s: (nonzero[s], -s)", "key=lambda s: (nonzero[s], s)",
      "on a tie the larger scaling is the slots'",
      equivalent="either rule is a function of the digested module scalings (one digest, one layout) and serves "
                 "each module's delta, folded in float32; which of two equally common scalings wins is a choice"),
    M("store.header-unchecked", "store.py",
      "if ckpt.tensors is None and source.read(len(ckpt.header.prefix), 0) != ckpt.header.prefix:", "if False:",
      "a file rewritten in place between its header's parse and the hash is served",
      equivalent="the hash of the bytes laid out, with the manifest of the header parsed, refuses every rewrite that "
                 "changes a served byte; what it lets through is exactly what was checked, and the check only names "
                 "the cause sooner"),
    M("reader.size-change-unchecked", "reader.py", "if not source.unchanged():", "if False:",
      "a file that changed size since its header was read is read anyway"),
    M("reader.misaligned-viewed", "reader.py", "raw = raw.clone()", "pass",
      "a tensor at an offset its dtype cannot be viewed at (a file may place it so) is viewed in place"),
    M("plan.all-zero-scaling-is-one", "plan.py", "return 0.0 if counts else 1.0", "return 1.0",
      "an adapter whose every module has scaling 0 (lora_alpha 0) serves its weights at scaling 1",
      equivalent="every module's ratio to the slots' scaling is then 0, folded into its B: the slot serves 0 as "
                 "with a scaling of 0"),
    M("reader.dense-b-rank-columns", "reader.py", "_copy_rows(b[..., : d.rank]", "_copy_rows(b[..., -d.rank :]",
      "a dense target's B lands in the last columns, not the first"),

    # --- plan.py ---
    M("plan.skew-zero", "plan.py", r"return -max\(fits\)\[1\] if fits else 0", "return 0",
      "the blocks start at their buffer's start whatever the file's alignment (slow copies)", regex=True),
    M("plan.staging-unskewed", "plan.py", "return at + (start - at) % SKEW", "return at + (-at) % dtype.itemsize",
      "staged reads land off the file's alignment (slow copies)"),
    M("plan.staging-misaligned", "plan.py", "return at + (-at) % dtype.itemsize", "return at + (start - at) % SKEW",
      "a file's tensors off their dtype's alignment (a header of odd length) are staged there and cannot be viewed"),
    M("plan.direct-b-below-max-rank", "plan.py", "if same and r == R:", "if same:",
      "a B of rank below max_rank is read straight into R-wide rows"),
    M("plan.a-shard-read-whole", "plan.py", "if a.columns != (0, cols):", "if False:",
      "a row target's column shard of A is read as if whole"),
    M("plan.dense-mixed-ranks", "plan.py", "len(ranks) == 1 and whole", "len(ranks) >= 1 and whole",
      "a target whose modules differ in rank is moved as one dense [layers, out, r] copy"),
    M("plan.dense-partial-layers", "plan.py", "if name not in read_direct and len(ranks) == 1 and whole:",
      "if name not in read_direct and len(ranks) == 1:",
      "a target some layers lack is moved as if every layer had it"),
    M("plan.never-partial", "plan.py", "and filled[n] < layout.targets[n].weight_bytes // item)",
      "and filled[n] < 0)", "no block counts as partly filled, so a reused one is never zeroed whole"),
    M("plan.joins-non-adjacent", "plan.py", "if at != end or len(parts) == IOV_MAX",
      "if at < end or len(parts) == IOV_MAX",
      "a read that starts past the last one's end is joined to it"),
    M("plan.exact-flag-flipped", "plan.py", "A.torch_dtype == layout.dtype) for m, loc, A, _ in placed)",
      "A.torch_dtype != layout.dtype) for m, loc, A, _ in placed)",
      "a target cast from another dtype is folded in place after the cast (rounded twice)"),
    M("plan.smallest-rank", "plan.py", "max(ranks, default=0)", "min(ranks, default=0)",
      "an adapter's rank is its smallest module's"),
    M("plan.dense-b-placement", "plan.py", "to = at + (p.layer * tl.b_shape[1] + p.to_rows[0]) * size",
      "to = at + p.layer * tl.b_shape[1] * size", "a dense target's slices land on each other in staging"),

    # --- layout.py ---
    M("layout.block-unaligned", "layout.py", "return aligned(self.numel * self.dtype.itemsize)",
      "return self.numel * self.dtype.itemsize", "blocks follow each other off the alignment"),
    M("layout.aligned-rounds-down", "layout.py", "return -(-nbytes // ALIGN) * ALIGN", "return nbytes // ALIGN * ALIGN",
      "alignment rounds down: b overlaps a's tail"),
    M("layout.carve-vs-offsets", "layout.py", "blocks[n] = buf[at : at + t.numel * self.dtype.itemsize]"
      ".view(self.dtype)\n            at += t.nbytes", "blocks[n] = buf[at : at + t.numel * self.dtype.itemsize]"
      ".view(self.dtype)\n            at += t.numel * self.dtype.itemsize",
      "the blocks are carved where offsets() does not put them"),
    M("layout.b-rows-shifted", "layout.py", "return tuple(itertools.accumulate(self.widths, initial=0))[:-1]",
      "return tuple(itertools.accumulate(self.widths, initial=0))[1:]",
      "a slice's rows of b start where the next slice's should"),

    # --- spec.py: the sharding rule ---
    M("spec.kv-replica-by-modulo", "spec.py", "u = rank // (world_size // units)", "u = rank % units",
      "few KV heads over many ranks: ranks take heads round-robin instead of in runs"),
    M("spec.replicated-a-sharded", "spec.py", "if self.parallel != \"row\":", "if self.parallel == \"column\":",
      "a replicated target's A is split by input like a row target's"),
    M("spec.replicated-b-sharded", "spec.py", "if self.parallel != \"column\":", "if self.parallel == \"row\":",
      "a replicated target's B is split by rows like a column target's"),
    M("spec.shard-by-rows-not-heads", "spec.py", "units = self.heads[s] if self.heads and self.heads[s] else out",
      "units = out", "a column slice shards by rows, not whole heads"),
    M("spec.leading-zero-index", "spec.py", "(text == \"0\" or text[0] != \"0\")", "True",
      "layers.01 is read as layer 1, a name PEFT never writes"),
    M("spec.fused-rows-not-advanced", "spec.py", "            out[sl] = at\n            at += self.out_features[sl]",
      "            out[sl] = at", "a fused module's B is split at row 0 for every slice"),

    # --- digest.py ---
    M("digest.no-scaling", "digest.py", "scaling = scalings[module].hex()", "scaling = ''",
      "two adapters that differ only in alpha share a digest"),
    M("digest.no-shape", "digest.py", "[module, role, e.dtype, list(e.shape), scaling]",
      "[module, role, e.dtype, scaling]", "the same bytes split at other ranks between modules digest alike"),
    M("digest.last-run-dropped", "digest.py", "    if start is not None:\n        yield start, stop", "",
      "the last run of bytes is not hashed"),
    M("digest.chunk-tail-unhashed", "digest.py", "            h.update(view)", "            h.update(view[:-1])",
      "the last byte of every chunk is laid out but not hashed: weights differing there share a digest"),
    M("source.strided-pushed", "source.py", "if t.device.type != \"cpu\" or not t.is_contiguous():",
      "if t.device.type != \"cpu\":", "a pushed non-contiguous tensor is read and hashed as its raw memory"),

    # --- store.py ---
    M("store.keep-ignored", "store.py", "for old in [n for n in self._held if n != name and n not in keep]:",
      "for old in [n for n in self._held if n != name]:", "hold drops adapters the running batch keeps"),
    M("store.most-recent-dropped", "store.py", "for old in [n for n in self._held if n != name and n not in keep]:",
      "for old in [n for n in reversed(self._held) if n != name and n not in keep]:",
      "hold drops the most recent instead of the least"),
    M("store.capacity-off-by-one", "store.py", "over = len(self._held) - self.spec.capacity",
      "over = len(self._held) - self.spec.capacity - 1", "the host tier holds one past capacity"),
    M("store.put-not-held", "store.py", "if adapter.name not in self._held:\n                return False",
      "if False:\n                return False", "a copy put after its name was dropped is kept"),
    M("store.digest-unverified", "store.py", "if found != digest:", "if False:",
      "a read with a digest serves weights that digest otherwise"),
    M("store.stale-copy-returned", "store.py", "if copy is not None and (digest is None or copy.digest == digest):",
      "if copy is not None:", "load returns a copy read under another digest"),
    M("store.version-not-per-read", "store.py", "else (\"read\", self.serial)", "else (\"read\", 0)",
      "every read without a digest is one version: a slot keeps serving old weights"),
    M("store.budget-ignored", "store.py",
      "excess = sum(self._sizes.values()) - self.max_bytes if self.max_bytes is not None else 0", "excess = 0",
      "the host tier's byte budget is not kept"),

    # --- pool.py ---
    M("pool.no-fill", "pool.py", "if name in self._written[slot]:", "if False:",
      "a target the new adapter lacks keeps the slot's last adapter's weights"),
    M("pool.always-fill", "pool.py", "if name in self._written[slot]:", "if True:",
      "a target never written is cleared again on every activation (wasted copies)"),
    M("pool.version-ignored", "pool.py", "if slot is not None and self._versions[slot] == adapter.version:",
      "if slot is not None:", "a reloaded adapter's slot keeps the old weights"),
    M("pool.freed-slot-last", "pool.py", "self._recent.move_to_end(slot, last=False)", "self._recent.move_to_end(slot)",
      "a deactivated adapter's slot is taken last, evicting a resident adapter first"),
    M("pool.scaling-not-set", "pool.py", "self.scaling[slot] = adapter.scaling", "pass",
      "a slot keeps its last adapter's scaling"),
    M("pool.ranks-at-max", "pool.py", "row[at : at + n] = ranks.flatten() if ranks is not None else self.spec.max_rank",
      "row[at : at + n] = self.spec.max_rank", "every slot's modules are taken at max_rank"),
    M("pool.dtype-unchecked", "pool.py", "or a.dtype != self.dtype:", ":",
      "an adapter of another dtype is cast into the slot silently"),

    # --- manager.py ---
    M("manager.admits-past-slots", "manager.py", "(v.key in active or len(active) < self.slots)",
      "(v.key in active or len(active) <= self.slots)", "one adapter more than the device has slots is admitted"),
    M("manager.queue-overtaken", "manager.py", "break  # in queue order", "continue  # in queue order",
      "a later, smaller adapter takes the host room an earlier one waits for"),
    M("manager.running-version-dropped", "manager.py",
      "return key is not None and not self.registry.is_current(key) and key not in pinned",
      "return key is not None and not self.registry.is_current(key)",
      "a reload drops the old version while requests still run on it"),
    M("manager.failure-unrecorded", "manager.py", "entry.error = error\n", "pass\n",
      "a failed read leaves its requests waiting forever"),
    M("manager.failure-not-cleared", "manager.py", "entry.error = None  # told", "pass  # told",
      "a failed adapter registered again is never read again",
      equivalent="a failed version is refused until registered again, and registering clears its entry's error "
                 "(_register), so no step reads it while the stale error stands"),
    M("manager.hits-misses-swapped", "manager.py", "self._counters.host_hits += 1", "self._counters.host_misses += 1",
      "a host hit is counted as a miss"),
    M("manager.every-wait-counted", "manager.py", "fresh = [v for rid, v in wanted.items() if rid not in self._seen]",
      "fresh = list(wanted.values())", "a request is counted a hit or miss at every step it waits"),
    M("manager.pin-name-unchecked", "manager.py", "elif r.id in self._pinned and self._pinned[r.id].name == r.adapter:",
      "elif r.id in self._pinned:", "a running request that switched adapters keeps the old one's slot"),
    M("versions.budget-boundary", "versions.py", "v.nbytes[n] > s.max_bytes:", "v.nbytes[n] >= s.max_bytes:",
      "an adapter exactly the size of the host budget is refused"),

    # --- ranks.py ---
    M("ranks.max-not-min", "ranks.py", "op=dist.ReduceOp.MIN", "op=dist.ReduceOp.MAX",
      "an adapter in on one rank is used everywhere"),
    M("ranks.no-agreement", "ranks.py", "    if group is None or not states:\n        return list(states)\n",
      "    return list(states)\n", "each rank decides alone"),

    # --- adapter_config.py ---
    M("adapter_config.rslora-swapped", "adapter_config.py",
      "return alpha / math.sqrt(r) if self.use_rslora else alpha / r",
      "return alpha / r if self.use_rslora else alpha / math.sqrt(r)", "rsLoRA's scaling and plain LoRA's swapped"),
    M("adapter_config.scale-by-default-rank", "adapter_config.py",
      "_pattern_value(self.alpha_pattern, module, self.lora_alpha), self.rank_of(module))",
      "_pattern_value(self.alpha_pattern, module, self.lora_alpha), self.r)",
      "a module's scaling divides by the config's r, not its own rank"),
    M("adapter_config.exclude-ignored", "adapter_config.py",
      "if self.exclude_modules and _names(self.exclude_modules, module):", "if False:",
      "weights exclude_modules leaves out are served"),
    M("adapter_config.suffix-not-dotted", "adapter_config.py",
      "any(module[i + 1 :] in names for i, ch in enumerate(module) if ch == \".\")",
      "any(module.endswith(n) for n in names)",
      "target_modules ['up_proj'] also takes gate_up_proj"),
    M("adapter_config.rank-zero-accepted", "adapter_config.py", "not 1 <= v <= MAX_RANK", "not 0 <= v <= MAX_RANK",
      "r 0 is accepted"),
    M("adapter_config.dora-served", "adapter_config.py", "    for key, why in UNSERVED_OPTIONS.items():\n"
      "        if raw.get(key):\n            problems.append(why)\n", "",
      "DoRA and the other unserved options are served"),

    # --- patterns.py ---
    M("patterns.regex-after-plain-wins", "patterns.py", "if best is not None and i > best:\n                break",
      "if False:\n                break", "a regex key later than a matching plain key wins"),
    M("patterns.suffix-only-at-start", "patterns.py",
      "starts = [0] + [j + 1 for j, ch in enumerate(name[:line]) if ch == \".\"]", "starts = [0]",
      "a plain key matches only the whole module name, not a dotted suffix"),
    M("patterns.regex-no-dot-boundary", "patterns.py", "return rf\"(.*\\.)?({key})$\"", "return rf\"(.*)?({key})$\"",
      "a regex key matches mid-name (up|down)_proj takes gate_up_proj"),

    M("patterns.atomic-group-to-re", "patterns.py",
      "elif op not in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.AT):",
      "elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.BRANCH):",
      "a repeat inside an atomic group or a lookaround goes to re, which backtracks exponentially (a hang)"),

    # --- source.py, memory.py: pushed tensors' storage ---
    M("source.storage-unchecked-at-read", "source.py", "why = storage_shortfall(t)\n", "why = None\n",
      "a tensor freed after its push is read at its old address (other memory, or a SIGSEGV)"),
    M("source.view-offset-ignored", "source.py", "need = t.storage_offset() * t.element_size() + t.nbytes",
      "need = t.nbytes", "a view into a shrunk storage is read past the storage's end"),
    M("source.subclass-read", "source.py",
      "if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:", "if False:",
      "a FakeTensor or DTensor is read as if its storage held its values"),

    # --- adapter_config.py: layers_to_transform by PEFT's rule, residual inits ---
    M("adapter_config.whole-name-restricted", "adapter_config.py",
      "if isinstance(self.target_modules, frozenset) and module in self.target_modules:\n            return True\n",
      "if False:\n            return True\n",
      "a module target_modules names whole is refused outside layers_to_transform, which PEFT serves"),
    M("adapter_config.empty-layers-restrict", "adapter_config.py", "if not self.layers_to_transform:\n",
      "if self.layers_to_transform is None:\n", "an empty layers_to_transform refuses every module"),
    M("adapter_config.layer-index-any-word", "adapter_config.py", r'r".*?\.[^.]*\.(?P<idx>\d+)\."',
      r'r".*?\.(?P<idx>\d+)\."', "the layer index is read after one dotted word, where PEFT wants two"),
    M("adapter_config.layers-pattern-ignored", "adapter_config.py", "self.layers_pattern or (None,)",
      "(None,)", "layers_pattern is ignored: the index after another word restricts the layers"),
    M("adapter_config.parameters-restricted", "adapter_config.py",
      "if self.target_parameters and _names(self.target_parameters, module):", "if False:",
      "stacked experts' layers outside layers_to_transform are refused, which PEFT's target_parameters serve",
      tests=(f"{T}expert_folds.py",)),
    M("adapter_config.lora-ga-served", "adapter_config.py", "\"loftq\", \"lora_ga\")", "\"loftq\")",
      "a LoRA-GA adapter is served on an unchanged base, off by scaling * B0 A0"),

    # --- check.py ---
    M("check.rank-vs-config-unchecked", "check.py", "if config is not None and r != config.rank_of(module):",
      "if False:", "a module whose rank the config does not give is served at a guessed scaling"),
    M("check.layer-past-end", "check.py", "if layer >= t.layers:", "if layer > t.layers:",
      "a module one layer past the model's last is accepted"),
    M("check.max-rank-boundary", "check.py", "if r > spec.max_rank:", "if r >= spec.max_rank:",
      "an adapter of rank max_rank is refused"),
    M("check.in-width-unchecked", "check.py", "if a[1] != t.in_features:", "if False:",
      "an A of the wrong input width is accepted"),
    M("check.mixed-dtypes-accepted", "check.py", "or b.dtype != a.dtype:", ":",
      "A and B of different dtypes are accepted"),
    M("check.double-spelling-accepted", "check.py", "if (loc.target, loc.layer, sl) in placed:", "if False:",
      "a module spelled twice in one file is served from one spelling, guessed"),
    M("check.unmapped-by-any-node", "check.py", "set.intersection(*(set(i.unmapped) for i in infos))",
      "set.union(*(set(i.unmapped) for i in infos))", "a module another node maps is refused"),
    M("check.untargeted-accepted", "check.py", "if config is not None and not config.targets(module):", "if False:",
      "weights target_modules leaves out are served, though PEFT drops them"),
    M("check.empty-accepted", "check.py", "if not ckpt.header.tensors:", "if False:",
      "a file with no weights serves the base model under an adapter's name"),
    M("check.lm-head-accepted", "check.py", "if module.rsplit(\".\", 1)[-1] in _VOCAB_MODULES:", "if False:",
      "LoRA on lm_head or the embeddings is accepted"),

    # --- experts.py ---
    M("experts.orientation-labels-swapped", "experts.py",
      "if (a_shape[1], b_shape[0]) == (fan_in, fan_out):\n        fits.append(\"A in\")",
      "if (a_shape[1], b_shape[0]) == (fan_in, fan_out):\n        fits.append(\"A out\")",
      "stacked experts whose A is on the input side are read as if on the output side"),
    M("experts.square-guessed", "experts.py", "elif len(ways) == 2 and len(shown) == 1:",
      "elif len(ways) == 2 and len(shown) >= 0:", "a square expert with nothing showing its side is guessed"),
    M("experts.rank-boundary", "experts.py", "if a_shape[0] // count > max_rank:",
      "if a_shape[0] // count >= max_rank:",
      "stacked experts at the experts' max_rank are refused"),
    M("experts.widths-one-slice", "experts.py", "return t.in_features, per * t.out_features[0]",
      "return t.in_features, t.out_features[0]", "an expert's output spans one slice, not gate and up"),
    # --- the spec derived from the model (issue 25) ---
    M("sites.interleave-flipped", "models/sites.py", 'gated and not getattr(module, "is_concatenated", True)',
      'gated and getattr(module, "is_concatenated", True)', "gate and up read interleaved where concatenated"),
    M("sites.transposed-ignored", "models/sites.py", 'return "in_out" if marked else "out_in"', 'return "out_in"',
      "experts marked is_transposed read as [E, out, in]"),
    M("sites.down-side-flipped", "models/sites.py", "(d2 == hidden) != down", "(d2 == hidden)",
      "an unmarked down projection's input taken for its output"),
    M("rules.kv-heads-are-query-heads", "models/rules.py",
      'n = field(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or q', "n = q",
      "k and v shard by the query's heads, not replicating KV heads past their count"),
    M("rules.transposed-styles-not-swapped", "models/rules.py",
      'return {"column": "row", "row": "column"}.get(parallel, parallel) if transposed else parallel',
      "return parallel", "a plan's style on [E, in, out] experts read as on a linear's weight"),
    M("rules.packed-sliced-by-guess", "models/rules.py", "if q and head_dim and width == (q + 2 * kv) * head_dim:",
      "if q and head_dim:", "a qkv linear split into q, k, v whatever its width"),
    M("derived.some-layers-as-all", "models/derived.py", "        ids = layers\n", "        ids = None\n",
      "a target on some layers laid out as if on every one"),
    M("derived.fuse-apart-sharded", "models/derived.py", "(s.prefix, s.parent, g.layers, s.in_features, g.parallel)",
      "(s.prefix, s.parent, g.layers, s.in_features)", "siblings the plan shards apart fused into one target"),
    M("derived.keys-nesting-reversed", "models/derived.py", "params[len(params) - 1 - depth]", "params[depth]",
      "PEFT's nested wrappers read outermost first: gate_up's factors as down's"),
]
