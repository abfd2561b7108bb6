"""Kernel sets by microarchitecture: a set tuned on one VM serves every CPU with the same
vendor, family and model (and vector family), whatever the hypervisor reports for cache
sizes, core count or model name; another model gets none."""
import json
from dataclasses import replace

import numpy as np
import pytest

import ttile
from conftest import forget_choices, requires_avx512
from ttile import Isa, KernelKind, SetMatch
from ttile.core.cpuinfo import CpuFingerprint, microarchitecture
from ttile.core.reference import conv_mismatch
from ttile.generator.data import DataKind, find_cpu_file, installed_directory
from ttile.runtime import registry


def _shipped_fingerprints() -> list[CpuFingerprint]:
    """The full fingerprints of the CPUs the wheel ships sets for (from their tables)."""
    directory = installed_directory(DataKind.MICROKERNELS)
    assert directory is not None, "ttile's microkernel tables are installed"
    found = {}
    for path in sorted(directory.glob("*.json")):
        cpu = CpuFingerprint.from_json(json.loads(path.read_text())["cpu"])
        if any(e.cpu == cpu.id for e in registry.ENTRIES):
            found[cpu.id] = cpu
    assert found, "the shipped sets' CPUs have microkernel tables"
    return list(found.values())


def _variants(cpu: CpuFingerprint) -> list[CpuFingerprint]:
    """The same core as other VMs report it."""
    return [replace(cpu, l3_bytes=480 << 20),
            replace(cpu, l3_bytes=cpu.l3_bytes // 2, l2_bytes=cpu.l2_bytes),
            replace(cpu, model_name=cpu.model_name + " (another VM)"),
            replace(cpu, l1d_bytes=0, l2_bytes=0, l3_bytes=0)]   # sysfs unreadable


@pytest.mark.parametrize("cpu", _shipped_fingerprints(), ids=lambda c: c.id)
def test_the_same_core_in_another_vm_gets_the_set(cpu):
    isa = next(e.isa for e in registry.ENTRIES if e.cpu == cpu.id)
    assert registry.match_set(cpu.id, isa) == registry.KernelSet(cpu.id, SetMatch.EXACT)
    for other in _variants(cpu):
        assert other.id != cpu.id and microarchitecture(other.id) == microarchitecture(cpu.id)
        assert registry.match_set(other.id, isa) == registry.KernelSet(
            cpu.id, SetMatch.MICROARCHITECTURE), other


@pytest.mark.parametrize("cpu", _shipped_fingerprints(), ids=lambda c: c.id)
def test_another_model_or_vendor_gets_none(cpu):
    isa = next(e.isa for e in registry.ENTRIES if e.cpu == cpu.id)
    for other in (replace(cpu, model=str(int(cpu.model) + 100)),
                  replace(cpu, family=str(int(cpu.family) + 100)),
                  replace(cpu, vendor="SomeoneElse")):
        assert registry.match_set(other.id, isa) == registry.KernelSet(None, SetMatch.NONE)


def test_the_vector_family_is_a_hard_requirement():
    """A set with AVX-512F verdicts only serves no AVX2 call, same core or not."""
    avx512_only = {e.cpu for e in registry.ENTRIES if e.isa is Isa.AVX512F} \
        - {e.cpu for e in registry.ENTRIES if e.isa is Isa.AVX2}
    assert avx512_only, "some shipped set has no AVX2 verdicts"
    cpu = sorted(avx512_only)[0]
    assert registry.match_set(cpu, Isa.AVX2).match is SetMatch.NONE
    assert registry.match_set(microarchitecture(cpu) + "-00000000", Isa.AVX2).cpu is None


def test_the_set_with_most_verdicts_wins_a_tie_of_cores():
    entries = registry.ENTRIES[:3]
    a = replace(entries[0], cpu="vendor-1-2-aaaaaaaa")
    b = [replace(e, cpu="vendor-1-2-bbbbbbbb", isa=entries[0].isa) for e in entries[1:]]
    chosen = registry.match_set("vendor-1-2-cccccccc", entries[0].isa, (a, *b))
    assert chosen == registry.KernelSet("vendor-1-2-bbbbbbbb", SetMatch.MICROARCHITECTURE)


@requires_avx512
def test_a_call_on_the_same_core_in_another_vm_runs_the_set():
    """End to end: pretending to be the Xeon model 167 with the L3 another VM reports, a
    layer of its set is served by its searched kernel, ``plan`` names the set and the
    match, ``tuned_kernels`` says the set serves here, and the result is right."""
    xeon = [c for c in _shipped_fingerprints() if c.vendor == "GenuineIntel"]
    cpu = xeon[0] if xeon else _shipped_fingerprints()[0]
    stranger = replace(cpu, l3_bytes=480 << 20)
    entry = next(e for e in registry.KERNELS
                 if e.cpu == cpu.id and e.isa is Isa.AVX512F and e.threads == 1)
    spec = entry.spec
    x_shape, w_shape = spec.input_shape(), spec.weight_shape()
    padding = ((spec.pad_top, spec.pad_bottom), (spec.pad_left, spec.pad_right))
    stride = (spec.stride_h, spec.stride_w)
    forget_choices()
    try:
        with registry.pretend_cpu(stranger.id):
            plan = ttile.plan(x_shape, w_shape, stride=stride, padding=padding,
                              layout="NHWC", threads=1, prepacked=True)
            assert (plan.kernel_set, plan.set_match) == (cpu.id, SetMatch.MICROARCHITECTURE)
            assert plan.kind is KernelKind.TUNED and plan.tuned_cpu == cpu.id
            assert "same microarchitecture" in plan.note
            listed = [k for k in ttile.tuned_kernels() if k["cpu"] == cpu.id]
            assert listed and all(k["serves_here"] and k["set_match"] == "microarchitecture"
                                  for k in listed)
            rng = np.random.default_rng(3)
            x = rng.uniform(-1, 1, x_shape).astype(np.float32)
            w = rng.uniform(-1, 1, w_shape).astype(np.float32)
            y = ttile.Conv2d(w, stride=stride, padding=padding, layout="NHWC")(x, threads=1)
            assert conv_mismatch(y, x, w, stride, (spec.pad_top, spec.pad_bottom,
                                                   spec.pad_left, spec.pad_right)) is None
        with registry.pretend_cpu(replace(cpu, model="9999").id):
            plan = ttile.plan(x_shape, w_shape, stride=stride, padding=padding,
                              layout="NHWC", threads=1, prepacked=True)
            assert (plan.kernel_set, plan.set_match) == (None, SetMatch.NONE)
            assert plan.kind is not KernelKind.TUNED
    finally:
        forget_choices()


def test_this_cpus_plan_names_its_set():
    plan = ttile.plan((1, 16, 8, 8), (16, 16, 3, 3), padding=1)
    serving = registry.serving_set(plan.isa) if plan.isa.vector else None
    if serving is None or serving.cpu is None:
        assert plan.set_match is SetMatch.NONE and plan.kernel_set is None
    else:
        assert (plan.kernel_set, plan.set_match) == (serving.cpu, serving.match)


def test_tables_of_the_same_core_are_found(tmp_path):
    """The generator's and the run-time tuner's microkernel tables are looked up the same
    way: this fingerprint's, else one measured on the same microarchitecture."""
    directory = tmp_path / DataKind.MICROKERNELS.value
    directory.mkdir()
    (directory / "vendor-6-167-11111111.json").write_text("{}")
    (directory / "vendor-6-167-22222222.avx2.json").write_text("{}")
    found = find_cpu_file(DataKind.MICROKERNELS, "vendor-6-167-33333333", tmp_path)
    assert found is not None and found.name == "vendor-6-167-11111111.json"
    found = find_cpu_file(DataKind.MICROKERNELS, "vendor-6-167-33333333.avx2", tmp_path)
    assert found is not None and found.name == "vendor-6-167-22222222.avx2.json"
    own = directory / "vendor-6-167-33333333.json"
    own.write_text("{}")
    assert find_cpu_file(DataKind.MICROKERNELS, "vendor-6-167-33333333", tmp_path) == own
    assert find_cpu_file(DataKind.MICROKERNELS, "vendor-6-168-33333333", tmp_path) is None
