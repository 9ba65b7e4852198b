// Shadows glibc's <sys/single_threaded.h> for the builder's compiles.
// libstdc++ reads ::__libc_single_threaded to skip atomics in single-threaded
// processes; that symbol is GLIBC_2.32, newer than manylinux_2_28 allows. A
// constant "not single-threaded" keeps every atomic and drops the symbol.
#pragma once
static const char __libc_single_threaded = 0;
