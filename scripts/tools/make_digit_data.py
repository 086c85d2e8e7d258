"""Write the embedded digit task as veRL parquet and OpenRLHF jsonl files (to try `data=files`).

    python scripts/tools/make_digit_data.py data/digits
    python run.py data=files data.train_files=[data/digits/verl/train.parquet] \
        data.val_files=[data/digits/verl/test.parquet] eval.every_n_steps=5
"""

import argparse
import json

from rlhf_orch.data.export import export_digit_task

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=1024)
    parser.add_argument("--test", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(export_digit_task(args.out_dir, args.train, args.test), indent=2))
