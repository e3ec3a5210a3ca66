"""Where a kernel's warps wait, from Nsight Compute's SASS source view (profile on the GPU
machine; the summary runs anywhere).

    ncu --clock-control none --set full -k 'regex:gdn_chunk_(apply|bwd_output)_kernel' -c 3 \
        -o prof python scripts/run_once.py gdn_ops.py 4x4096x16x32
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_stalls.py sass.csv [KERNEL_INDEX] [--module gdn_ops.py --shape 4x4096x16x32]

Prints, for each profiled kernel (or the one at KERNEL_INDEX), the warp-stall samples summed by
reason and by opcode, with each opcode's three main reasons: a load-latency-bound kernel shows
`long_sb` on the first instruction that reads a loaded register. With --module (the module that
ran, and the shape run_once.py ran it at) the samples are also summed per line of the module's
source: the kernel is compiled again here for sm_90 exactly as run_once.py launches it (the same
Triton, hence the same SASS, checked instruction by instruction against the profile) and
disassembled with its line table (BENCHMARKS.md round 20).
"""
import argparse, collections, csv, os, re, subprocess, sys, tempfile


def kernels(path):
    found, current = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            current = {"name": row[1], "header": None, "rows": []}
            found.append(current)
        elif row and row[0] == "Address" and current is not None:
            current["header"] = row
        elif row and row[0].startswith("0x") and current is not None:
            current["rows"].append(row)
    return found


def samples(kernel):
    """Per instruction: (opcode, total stall samples, {reason: samples})."""
    index = {name: i for i, name in enumerate(kernel["header"])}
    reasons = [n for n in kernel["header"] if n.startswith("stall_") and "Not Issued" not in n]
    out = []
    for row in kernel["rows"]:
        words = row[1].split()
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        out.append((opcode, int(row[index["Warp Stall Sampling (All Samples)"]] or 0),
                    {r[len("stall_"):]: int(row[index[r]] or 0) for r in reasons}))
    return out


def _print_table(title, totals, reasons, total, label, top):
    print(f"  {title}")
    for key, count in totals.most_common(top):
        main = ", ".join(f"{r} {100 * n / max(count, 1):.0f} %" for r, n in reasons[key].most_common(3))
        print(f"  {100 * count / total:5.1f} %  {label(key)}   [{main}]")


def summarize(kernel, lines=None, source=None, top=22):
    rows = samples(kernel)
    by_reason, by_opcode, by_line = collections.Counter(), collections.Counter(), collections.Counter()
    reasons_by_opcode, reasons_by_line = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for i, (opcode, count, reasons) in enumerate(rows):
        by_opcode[opcode] += count
        by_reason.update(reasons)
        reasons_by_opcode[opcode].update(reasons)
        if lines is not None:
            by_line[lines[i]] += count
            reasons_by_line[lines[i]].update(reasons)
    total = sum(by_reason.values()) or 1
    print(f"{kernel['name']}: {len(rows)} instructions, {total} stall samples")
    for reason, count in by_reason.most_common(10):
        print(f"  {reason:24s} {100 * count / total:5.1f} %")
    _print_table("by opcode", by_opcode, reasons_by_opcode, total, lambda op: f"{op:10s}", top)
    if lines is not None:
        text = source.split("\n")
        _print_table("by source line", by_line, reasons_by_line, total,
                     lambda n: f"L{n}  {text[n - 1].strip()[:100]}" if n else "(no line)", top)


def source_lines(module_path, kernel_name, shape, count):
    """The module's source line of each of the kernel's SASS instructions, compiled here as
    run_once.py launches it (meta tensors record the launch; nothing runs)."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import triton
    from lrdsl.measure.resources import _compile, _LaunchRecorder
    from run_once import call, load_module

    module = load_module(module_path)
    with _LaunchRecorder(module) as recorder:
        call(module, shape, "meta")
    launches = [(fn, args, kwargs) for fn, args, kwargs in recorder.launches if fn.__name__ == kernel_name]
    disassembler = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    for fn, args, kwargs in launches:  # a kernel launched at two chunk sizes: the one of `count` instructions
        compiled, _, _ = _compile(fn, args, dict(kwargs), 90)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            sass = subprocess.run([disassembler, "-g", "-c", cubin.name], capture_output=True, text=True, check=True).stdout
        lines, current = [], 0
        for text in sass.split("\n"):
            marker = re.search(r'//## File "([^"]+)", line (\d+)', text)
            if marker:  # inlined library code keeps the module line that called it
                if os.path.basename(marker.group(1)) == os.path.basename(module_path):
                    current = int(marker.group(2))
            elif re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", text):
                lines.append(current)
        if len(lines) == count:
            return lines
    raise SystemExit(f"no launch of {kernel_name} at {shape} compiles to the profiled {count} instructions")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("index", nargs="?", type=int)
    p.add_argument("--module")
    p.add_argument("--shape", default="4x4096x16x32")
    args = p.parse_args()
    found = kernels(args.csv)
    for kernel in ([found[args.index]] if args.index is not None else found):
        lines = source_lines(args.module, kernel["name"], args.shape, len(kernel["rows"])) if args.module else None
        summarize(kernel, lines, open(args.module).read() if args.module else None)
