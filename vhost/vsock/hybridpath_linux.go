package vsock

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// dialOwned dials the Unix socket at path only if path itself is a
// socket owned by this process's user: not a symlink (a user who can
// write to the directory could plant path_1021 -> another VM's
// path_1021 and reach hostd as that VM), not another user's socket. It
// opens path with O_PATH|O_NOFOLLOW, checks that inode, and connects
// through the descriptor's magic link, so the path cannot be swapped
// between the check and the connect. Defence in depth: the directory
// is root's.
func dialOwned(ctx context.Context, path string) (*net.UnixConn, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := ownedSocket(fd, path); err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", "/proc/self/fd/"+strconv.Itoa(fd))
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", path, err)
	}
	return c.(*net.UnixConn), nil
}

// isOwnedSocket reports whether path is a socket of this user's, not
// through a symlink: the guest's ports are refused (RST) otherwise.
func isOwnedSocket(path string) bool {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	return ownedSocket(fd, path) == nil
}

func ownedSocket(fd int, path string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("%s is not a socket (a symlink is refused)", path)
	}
	if int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%s is uid %d's socket, not this process's user's (%d): refused", path, st.Uid, os.Geteuid())
	}
	return nil
}
