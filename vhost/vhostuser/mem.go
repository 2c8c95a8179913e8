package vhostuser

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/vhost/virtq"
)

// setMemTable maps each region from its fd, after checking that the
// region lies inside the file (so no access can fault past its end), and
// replaces the old table; the rings are rebuilt on the new one.
func (s *Session) setMemTable(m *msg) error {
	rs, err := m.memTable()
	if err != nil {
		return err
	}
	var maps [][]byte
	var regions []virtq.Region
	undo := func() {
		for _, b := range maps {
			_ = unix.Munmap(b)
		}
	}
	page := uint64(os.Getpagesize())
	for i, r := range rs {
		var st unix.Stat_t
		if err := unix.Fstat(m.fds[i], &st); err != nil {
			undo()
			return err
		}
		end := r.offset + r.size
		if r.size == 0 || end < r.offset || end > uint64(st.Size) || r.size > 1<<46 {
			undo()
			return fmt.Errorf("SET_MEM_TABLE region %d: offset %#x size %#x beyond its fd's %#x bytes", i, r.offset, r.size, st.Size)
		}
		at := r.offset &^ (page - 1)
		b, err := unix.Mmap(m.fds[i], int64(at), int(end-at), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			undo()
			return fmt.Errorf("SET_MEM_TABLE region %d: mmap: %w", i, err)
		}
		maps = append(maps, b)
		regions = append(regions, virtq.Region{GPA: r.gpa, VA: r.va, Mem: b[r.offset-at:]})
	}
	mem, err := virtq.NewMemory(regions)
	if err != nil {
		undo()
		return err
	}
	s.invalidate(-1)
	s.unmap()
	s.mem, s.maps = mem, maps
	for i := range s.rings {
		s.ready(i)
	}
	return nil
}

func (s *Session) unmap() {
	s.invalidate(-1)
	for _, b := range s.maps {
		_ = unix.Munmap(b)
	}
	s.mem, s.maps = nil, nil
}
