#!/usr/bin/env python3
"""step_kernels.py - where one training step's GPU time goes, from an ncu CSV (bench/step_kernels.sh).

    step_kernels.py NCU.csv [--top N] [--step K]    (ncu --metrics gpu__time_duration.sum --csv
                                                     --print-units base ... > NCU.csv)
    step_kernels.py --self-test                     (checks the parsing and the sums on a made-up CSV)

A step is the launches after one AdamW launch (adamw_multi_kernel, which closes every optimizer step)
up to and including the next: the whole forward, backward, clip and update. --step K takes the K-th
complete step from the end (1, the default: the last one; the first steps of a run may still hold
one-off work such as the optimizer's table upload). Without two AdamW launches the whole window is
summed (and said so).

Printed: the step's kernel count and summed kernel time (the step's wall time is larger by the host's
gaps between launches), then the time per kernel family (FAMILIES below: the first pattern that
matches a kernel's name decides) and per kernel (name without template arguments or parameters),
largest first. Times are each kernel's gpu__time_duration under ncu, which runs kernels one at a
time: a step whose kernels overlap (collectives beside the work) sums to more than its wall time.
"""
import collections
import csv
import io
import re
import sys

FAMILIES = [
    ("grouped GEMM (sm90 wgmma)", r"gmm90_kernel"),
    ("grouped GEMM (other)", r"gmm_|grouped_matmul"),
    ("attention", r"^fa_|^fa90_|attention"),
    ("dense GEMM (cuBLASLt / cuBLAS)", r"nvjet|xmma_gemm|cutlass|splitKreduce|gemm|Gemm"),
    ("optimizer (AdamW, clip)", r"adamw|sumsq|scale_multi|sgd_kernel"),
    ("MoE dispatch (permute, unpermute, sort)", r"permute|unpermute|RadixSort|moe_sort|chunks_"),
    ("MoE router and losses", r"router|aux_scores|z_rows|z_backward|ml_|moe_loss|topk|^mg_"),
    ("norms", r"rmsnorm"),
    ("activations (SwiGLU, SiLU)", r"swiglu|silu|activation"),
    ("rope", r"rope"),
    ("cross-entropy", r"^ce_|cross_entropy"),
    ("embedding and indexing", r"^ix_"),
    ("copies and casts", r"xfer|copy|cast|memcpy|memset"),
    ("collectives (NCCL)", r"nccl"),
    ("elementwise and reductions", r"^ew_|reduce|fill"),
]
ADAMW = "adamw_multi_kernel"
UNIT_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}


GMM90_MODES = {"0": "FWD", "1": "DX", "2": "DW", "3": "FWD_SWIGLU"}


def short(name):
    """A kernel's name without its parameter list and template arguments (and any return type);
    the sm90 grouped GEMM keeps its direction (gmm90_kernel<MODE, ...>: FWD, DX, DW, FWD_SWIGLU)."""
    m = re.search(r"gmm90_kernel<(?:\(int\))?(\d)", name)
    if m:
        return f"gmm90_kernel {GMM90_MODES.get(m.group(1), m.group(1))}"
    n = re.sub(r"\(.*", "", name)
    depth, out = 0, []
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip().split(" ")[-1]


def family(name):
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def launches(text):
    """[(kernel name, ms)] in launch order from ncu's --csv output (other lines are skipped)."""
    lines = [l for l in text.splitlines(True) if l.startswith('"')]
    rows = []
    for r in csv.DictReader(io.StringIO("".join(lines))):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit") or "nsecond"
        if unit not in UNIT_MS:
            raise ValueError(f"unknown unit {unit!r} for {r['Kernel Name']}")
        rows.append((r["Kernel Name"], v * UNIT_MS[unit]))
    return rows


def one_step(rows, k=1):
    """The launches of the k-th complete step from the end, and a note on how it was found."""
    ad = [i for i, (n, _) in enumerate(rows) if ADAMW in n]
    if len(ad) < k + 1:
        return rows, f"{len(ad)} AdamW launches: the whole window ({len(rows)} kernels)"
    a, b = ad[-k - 1] + 1, ad[-k] + 1
    return rows[a:b], f"step {k} from the end: launches {a}..{b - 1}"


def report(rows, top=40):
    total = sum(v for _, v in rows)
    fam, per, cnt = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
    for n, v in rows:
        s = short(n)
        fam[family(s)] += v
        per[s] += v
        cnt[s] += 1
    out = [f"one step: {len(rows)} kernels, {total:.3f} ms of kernel time", "", f"{'family':44s} {'ms':>9s} {'share':>7s}"]
    for f, v in sorted(fam.items(), key=lambda x: -x[1]):
        out.append(f"{f:44s} {v:9.3f} {100 * v / total if total else 0:6.1f}%")
    out += ["", f"{'kernel':56s} {'calls':>6s} {'ms':>9s} {'mean us':>9s}"]
    for s, v in sorted(per.items(), key=lambda x: -x[1])[:top]:
        out.append(f"{s[:56]:56s} {cnt[s]:6d} {v:9.3f} {1e3 * v / cnt[s]:9.1f}")
    return "\n".join(out), fam, per


def self_test():
    hdr = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    seq = [("init_kernel", 5000), (ADAMW + "(tm__seg const*)", 900000),  # step 1 ends here
           ("void gmm90_kernel<0, 256, false>(CUtensorMap_st, gmm90_params)", 150000),
           ("void gmm90_kernel<(int)2, (int)256, (bool)0>(CUtensorMap_st, gmm90_params)", 200000),
           ("void fa_forward_kernel<64, 2, 64>(float)", 1.5), ("rope_rotate_kernel<bf16, 4>", 26000),
           (ADAMW + "(tm__seg const*)", 1000000)]  # step 2 ends here
    units = ["nsecond", "nsecond", "nsecond", "nsecond", "msecond", "nsecond", "nsecond"]
    text = "==PROF== noise\n" + hdr + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","{u}","{v:,}"\n' for i, ((n, v), u) in enumerate(zip(seq, units)))
    rows = launches(text)
    assert len(rows) == 7, rows
    step, note = one_step(rows)
    assert [short(n) for n, _ in step] == ["gmm90_kernel FWD", "gmm90_kernel DW", "fa_forward_kernel",
                                           "rope_rotate_kernel", ADAMW], (step, note)
    _, fam, per = report(step)
    expect = {"grouped GEMM (sm90 wgmma)": 0.35, "attention": 1.5, "rope": 0.026, "optimizer (AdamW, clip)": 1.0}
    for f, v in expect.items():
        assert abs(fam[f] - v) < 1e-9, (f, fam[f], v)
    assert abs(sum(per.values()) - 2.876) < 1e-9, per
    for name, want in [("void fa90_dkv_tma_kernel<64, 1, 3, 2>(CUtensorMap_st, fa90_p)", "attention"),
                       ("void mg_forward_kernel<8, 2, 1>(const __nv_bfloat16 *)", "MoE router and losses"),
                       ("mg_dw_reduce_kernel(const float *, float *)", "MoE router and losses")]:
        assert family(short(name)) == want, (name, family(short(name)))
    whole, note = one_step(rows[:3])
    assert len(whole) == 3 and "whole window" in note, note
    print("step_kernels.py self-test: ok")


def main(argv):
    if "--self-test" in argv:
        self_test()
        return 0
    args, top, k = [], 40, 1
    it = iter(argv)
    for a in it:
        if a == "--top":
            top = int(next(it))
        elif a == "--step":
            k = int(next(it))
        else:
            args.append(a)
    if len(args) != 1:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    with open(args[0]) as f:
        rows = launches(f.read())
    if not rows:
        print(f"step_kernels.py: no gpu__time_duration rows in {args[0]} (did ncu profile any kernel?)", file=sys.stderr)
        return 1
    step, note = one_step(rows, k)
    text, _, _ = report(step, top)
    print(f"{args[0]}: {note}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
