package guesttest

import (
	"fmt"

	"golang.org/x/sys/unix"
)

const ptySupported = true

// ptyRaw unlocks the master fd's terminal, makes it raw (cfmakeraw) and
// returns its number.
func ptyRaw(fd int) (int, error) {
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		return 0, fmt.Errorf("unlock: %w", err)
	}
	n, err := unix.IoctlGetUint32(fd, unix.TIOCGPTN)
	if err != nil {
		return 0, fmt.Errorf("number: %w", err)
	}
	tio, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return 0, fmt.Errorf("get termios: %w", err)
	}
	tio.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	tio.Oflag &^= unix.OPOST
	tio.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	tio.Cflag &^= unix.CSIZE | unix.PARENB
	tio.Cflag |= unix.CS8
	tio.Cc[unix.VMIN], tio.Cc[unix.VTIME] = 1, 0
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, tio); err != nil { // the terminal's settings, through its master
		return 0, fmt.Errorf("set termios: %w", err)
	}
	return int(n), nil
}
