"""BERT pretraining across mixed GPUs: see hsync/trainer/train.py, or run with --help."""

from hsync.trainer.train import main

if __name__ == "__main__":
    main()
