"""For environment authors: scaffold a folder, check it, check its tokens across turns."""
