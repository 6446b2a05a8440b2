"""Where each kernel's stall samples go, from Nsight Compute's per-instruction source page
(`ncu --import R --page source --csv --print-source sass`, as gpu_check.sh's ncu step writes it):
per kernel, the stall reasons' shares of all samples, and the opcodes holding the most samples and
the most executed instructions.

    python benchmarks/ncu_summary.py ncu_source.csv [--top 8]
"""
import argparse
import collections
import csv


def kernels(rows):
    """(kernel name, header, instruction rows) per profiled launch in the CSV; the page prints each
    launch's section twice in a row, and the repeat is read once (launches of one kernel in
    different cases are kept apart)."""
    sections = []  # [name, header, body]
    for row in rows:
        if row and row[0] == "Kernel Name":
            sections.append([row[1], None, []])
        elif sections and row and row[0] == "Address" and sections[-1][1] is None:
            sections[-1][1] = row
        elif sections and sections[-1][1] is not None and len(row) == len(sections[-1][1]):
            sections[-1][2].append(dict(zip(sections[-1][1], row)))
    previous = None
    for name, header, body in sections:
        if header is not None and (name, body) != previous:
            yield name, header, body
        previous = (name, body)


def opcode(source):
    """The opcode of a SASS line without its predicate and modifiers: "@!P0 HMMA.16816.F32" -> "HMMA"."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def short_name(name):
    """The kernel's name with its template arguments, without the return type and parameter list."""
    depth = 0
    for at, char in enumerate(name):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0:
            name = name[:at]
            break
    return name.removeprefix("void ")


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def shares(counter, top):
    total = sum(counter.values()) or 1.0
    return ", ".join(f"{key} {100 * value / total:.0f}%" for key, value in counter.most_common(top))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="the source page as CSV")
    parser.add_argument("--top", type=int, default=8, help="entries per line")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    for name, header, body in kernels(rows):
        # Not-issued samples are a subset of all samples: count each reason once.
        reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
        stalls, samples, executed = collections.Counter(), collections.Counter(), collections.Counter()
        for row in body:
            op = opcode(row["Source"])
            samples[op] += number(row["Warp Stall Sampling (All Samples)"])
            executed[op] += number(row["Instructions Executed"])
            for reason in reasons:
                stalls[reason[len("stall_"):]] += number(row[reason])
        print(short_name(name))
        print(f"  {int(sum(samples.values()))} samples, {int(sum(executed.values()))} warp instructions")
        print(f"  stall reasons: {shares(stalls, args.top)}")
        print(f"  samples by opcode: {shares(samples, args.top)}")
        print(f"  instructions by opcode: {shares(executed, args.top)}")


if __name__ == "__main__":
    main()
