//go:build linux

package sys

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Memfd creates an anonymous shared-memory file of the given size. The caller
// owns the returned file and closes it; the memory lives while any mapping or
// fd refers to it.
func Memfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("size memfd %s: %w", name, err)
	}
	return f, nil
}

// Sealed are the seals of a region memfd (SealedMemfd): nobody, hostd
// included, can grow it (so no guest can make it take more memory than
// it was charged for) or change its seals (so no guest can forbid the
// shrink by which hostd takes the memory back). It can still shrink.
const Sealed = unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// SealedMemfd creates an anonymous shared-memory file of size bytes,
// sealed with Sealed. The caller owns the returned file.
func SealedMemfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("size memfd %s: %w", name, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Sealed); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal memfd %s: %w", name, err)
	}
	return f, nil
}

// Seals returns the seals of f (F_GET_SEALS).
func Seals(f *os.File) (int, error) {
	n, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		return 0, fmt.Errorf("seals of %s: %w", f.Name(), err)
	}
	return n, nil
}

// Map maps size bytes of f shared and read-write. The mapping outlives f;
// release it with Unmap.
func Map(f *os.File, size int) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	return mem, nil
}

// Unmap releases a mapping made by Map.
func Unmap(mem []byte) error {
	if err := unix.Munmap(mem); err != nil {
		return fmt.Errorf("munmap: %w", err)
	}
	return nil
}

// Yield gives the CPU to another runnable thread on it, if any
// (sched_yield); it returns at once when there is none.
func Yield() { unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }
