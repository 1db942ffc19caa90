"""kvserve's C++ CPU kernels: building and loading the extension (`build`) and a typed wrapper
per op (`ops`). A leaf package: nothing in it imports the rest of kvserve."""
