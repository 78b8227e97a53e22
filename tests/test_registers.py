"""benchmarks/registers.py's count and listing of a kernel's main loop in an nvdisasm listing."""

from benchmarks.registers import loop_instructions, loop_listing

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR8][R2.64] ;
.L_x_2:
        /*0030*/                   FFMA R8, R4, R5, R8 ;
        /*0040*/               @P2 BRA `(.L_x_2) ;
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   EXIT ;
"""


def test_the_widest_backward_branch_is_the_loop():
    # .L_x_1's loop: LDG, FFMA, BRA, IADD3, BRA (the inner loop, 2, and the forward branch do not count)
    assert loop_instructions(LISTING) == 5


def test_a_listing_without_a_loop_counts_none():
    assert loop_instructions(LISTING.replace("@P1 BRA `(.L_x_1)", "NOP").replace("@P2 BRA `(.L_x_2)", "NOP")) == 0


def test_the_loop_listing_shows_its_loads_and_branches_at_their_places():
    assert loop_listing(LISTING) == [".L_x_1:", "    0 LDG.E.128.CONSTANT R4, desc[UR8][R2.64] ;", ".L_x_2:",
                                     "    2 @P2 BRA `(.L_x_2) ;", "    4 @P1 BRA `(.L_x_1) ;"]
