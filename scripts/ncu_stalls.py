"""Where a kernel's warps wait, from Nsight Compute's SASS source view (GPU machine with ncu).

    ncu --clock-control none --set full --import-source yes -k 'regex:gdn_chunk_(apply|bwd_output)_kernel' \
        -c 3 -o prof python scripts/run_once.py gdn_ops.py 4x4096x16x32
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_stalls.py sass.csv [KERNEL_INDEX]

Prints, for each profiled kernel (or the one at KERNEL_INDEX), the warp-stall samples summed by
reason and by opcode, with each opcode's three main reasons: a load-latency-bound kernel shows
`long_sb` on the first instruction that reads a loaded register (BENCHMARKS.md round 20).
"""
import collections, csv, sys


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


def summarize(kernel, top=22):
    index = {name: i for i, name in enumerate(kernel["header"])}
    reasons = [n for n in kernel["header"] if n.startswith("stall_") and "Not Issued" not in n]
    by_reason, by_opcode, executed = collections.Counter(), collections.Counter(), collections.Counter()
    reasons_by_opcode = collections.defaultdict(collections.Counter)
    for row in kernel["rows"]:
        words = row[1].split()
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        by_opcode[opcode] += int(row[index["Warp Stall Sampling (All Samples)"]] or 0)
        executed[opcode] += int(row[index["Instructions Executed"]] or 0)
        for reason in reasons:
            samples = int(row[index[reason]] or 0)
            by_reason[reason] += samples
            reasons_by_opcode[opcode][reason] += samples
    total = sum(by_reason.values()) or 1
    print(f"{kernel['name']}: {len(kernel['rows'])} instructions, {total} stall samples")
    for reason, samples in by_reason.most_common(10):
        print(f"  {reason:28s} {100 * samples / total:5.1f} %")
    print("  by opcode: samples %, instructions executed, main reasons")
    for opcode, samples in by_opcode.most_common(top):
        main = ", ".join(f"{r[6:]} {100 * n / max(samples, 1):.0f} %" for r, n in reasons_by_opcode[opcode].most_common(3))
        print(f"  {opcode:10s} {100 * samples / total:5.1f} %  {executed[opcode]:>11d}   [{main}]")


if __name__ == "__main__":
    found = kernels(sys.argv[1])
    for kernel in ([found[int(sys.argv[2])]] if len(sys.argv) > 2 else found):
        summarize(kernel)
