/* A stand-in for Windows' bcryptprimitives.dll, for Wine 8 (Debian 12), which lacks it.
 *
 * Rust's standard library (since 1.78) and getrandom 0.3 import ProcessPrng from
 * bcryptprimitives.dll, present on every Windows 10 and later; Wine gained it in 9.x. Without
 * it a Rust .exe does not even load under Debian's Wine (status c0000135). This DLL exports
 * ProcessPrng on top of RtlGenRandom (advapi32's SystemFunction036), which Wine implements
 * from the host's random source. Only the tests use it: scripts/setup builds it with mingw-w64
 * into the Wine prefix; nothing here ships with tunnel.
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
    while (len > 0) {
        ULONG n = len > 0x40000000 ? 0x40000000 : (ULONG)len;
        if (!SystemFunction036(data, n))
            return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}
