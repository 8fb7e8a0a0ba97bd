"""BERT pretraining across mixed GPUs: see hsync/apps/bert/train.py, or run with --help."""

from hsync.apps.bert.train import main

if __name__ == "__main__":
    main()
