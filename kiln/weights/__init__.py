"""An artifact's weights file, written from a checkpoint as the compiled graph stores it (convert:
compile and `kiln attach-weights`, attach) or drawn seeded at random from the manifest alone
(generated: `kiln fill-weights`). The safetensors reading and writing is kiln/safetensors_io.py's,
a leaf the frontend and the runtime read checkpoints and weights with too."""
