"""torchrun --nproc_per_node=N train.py --job.config recipes/llama_gefen.toml [--section.key value ...]"""

from gefen_titan.train import main

if __name__ == "__main__":
    main()
