"""A dataset_generator.py as Paddle users write them, run by --pipe-command (no paddle needed).

Paddle's Dataset feeds each data file to ``pipe_command`` and reads MultiSlot lines from
its stdout: for each declared input in order, a count and then the values.  The class
below stands in for ``paddle.distributed.fleet.data_generator.MultiSlotDataGenerator``
(same ``generate_sample`` / ``run_from_stdin`` contract); CriteoDataset is the reference
documents' example, with hex categoricals read as integers (Python's ``hash`` of a str
differs between processes).  ``--fail`` exits 3 after a message on stderr (for the tests).
"""
import sys

CONT_MIN = [0, -3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
CONT_DIFF = [20, 603, 100, 50, 64000, 500, 100, 50, 500, 10, 10, 10, 50]


class MultiSlotDataGenerator:  # stand-in for Paddle's, printing the same lines
    def run_from_stdin(self):
        for line in sys.stdin:
            for sample in self.generate_sample(line)():
                print(" ".join(" ".join([str(len(v))] + [str(x) for x in v]) for _, v in sample))


class CriteoDataset(MultiSlotDataGenerator):
    def generate_sample(self, line):
        def reader():
            f = line.rstrip("\n").split("\t")
            dense = [0.0 if f[i] == "" else (float(f[i]) - CONT_MIN[i - 1]) / CONT_DIFF[i - 1]
                     for i in range(1, 14)]
            sparse = [[int(f[i], 16)] if f[i] else [] for i in range(14, 40)]
            yield ([("dense_feature", dense)] + [(f"C{i + 1}", s) for i, s in enumerate(sparse)]
                   + [("label", [int(f[0])])])
        return reader


if __name__ == "__main__":
    if sys.argv[1:] == ["--fail"]:
        sys.stderr.write("reading stdin\nboom: bad input\n")
        sys.exit(3)
    CriteoDataset().run_from_stdin()
