"""attnlab's Hydra configs; an installed attnlab ships this folder as the package `attnlab_configs`."""
