# Installs decodev2 for C and C++ hosts: the shared library, the header and a pkg-config file.
#   make install PREFIX=/usr/local          # cargo build --release, then the files below
#   make install-files PREFIX=DIR BUILT_LIB=path/libdecodev2.so   # an already built library
# Then: cc app.c $(pkg-config --cflags --libs decodev2)   (PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig
# where PREFIX is not a system one); the flags carry an rpath, so the program finds the
# library without LD_LIBRARY_PATH.
PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
BUILT_LIB  ?= target/release/libdecodev2.so
VERSION    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

.PHONY: install install-files
install:
	cargo build --release --lib
	$(MAKE) install-files

install-files:
	install -d $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)
	install -m 755 $(BUILT_LIB) $(DESTDIR)$(LIBDIR)/libdecodev2.so
	install -m 644 include/decodev2.h $(DESTDIR)$(INCLUDEDIR)/decodev2.h
	sed -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' -e 's|@VERSION@|$(VERSION)|' \
	  install/decodev2.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/decodev2.pc
